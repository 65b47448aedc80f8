"""The program file format: one flatbuffers schema (``program.fbs``), its generated code
(``generated/``, rebuilt by ``scripts/regen_schema.sh``), the writer (AOT side) and the reader (runtime
side). The file layout is described in ``header.py``."""

from .reader import ProgramFile, load_program
from .writer import save_program

__all__ = ["ProgramFile", "load_program", "save_program"]
