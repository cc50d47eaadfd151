"""The one hand-moved clock of the suite (a helper module, not a test module): monotonic or wall, as the code
under test uses it; a step is an assignment to ``now`` or a call to :meth:`advance`."""


class ManualClock:
    """A stand-in clock the test moves by hand, so deadlines, windows and trends are judged on known steps."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now
