"""The commands' rate limit: token buckets fed with arrival times (tests need no sleeping), one per sender class."""

from typing import Optional


class TokenBucket:
    """``rate`` per second sustained, ``burst`` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp: Optional[float] = None

    def take(self, now: float) -> bool:
        if self.stamp is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


SIGNED, OTHER = "signed", "other"  # a command whose signature checked out against the command key; the rest


class ClassBuckets:
    """One :class:`TokenBucket` per sender class, so a flood of one class cannot take another's tokens.

    Commands verified against the command key (:data:`SIGNED`) have a bucket of their own; everything else
    (unsigned, badly signed, announces, and every command on a box without a key) shares :data:`OTHER`.
    Each bucket has the configured ``rate`` and ``burst``.
    """

    def __init__(self, rate: float, burst: int) -> None:
        self._buckets = {SIGNED: TokenBucket(rate, burst), OTHER: TokenBucket(rate, burst)}

    def take(self, sender: str, now: float) -> bool:
        return self._buckets[sender].take(now)
