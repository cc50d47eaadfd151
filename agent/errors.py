"""Exceptions shared across groups: raised in one room, turned into an ack or an exit status in another."""

from typing import Optional


class CommandError(Exception):
    """Fails a command with a machine-readable code (and the field at fault); the dispatcher turns it into an ack.

    Raised by command handlers and by the model manager (a deploy refused), caught by ``agent.commands.dispatcher``.
    """

    def __init__(self, code: str, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
