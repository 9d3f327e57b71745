"""Why a process cannot be sampled or timed: one line a user can act on."""


class PythonAttachError(Exception):
    """A process cannot be sampled; the message is one line a user can act on."""


class UnsupportedInterpreter(PythonAttachError):
    """The process runs no CPython this module knows how to read (or whose layout does not verify)."""


class InterpreterNotReady(UnsupportedInterpreter):
    """A known CPython whose runtime has no interpreter or thread yet (starting up, or finalizing)."""
