"""The error a malformed program raises, shared by the program's data modules and the runtime."""


class ProgramError(ValueError):
    """A program file (or a weights file it names) is malformed, truncated or inconsistent."""
