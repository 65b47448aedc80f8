"""The program file format: one flatbuffers schema (``program.fbs``), its generated code
(``generated/``, rebuilt by ``scripts/regen_schema.sh``), the writer (AOT side) and the reader (runtime
side). The file layout is described in ``header.py``.

``save_program`` and ``load_program`` are imported on first use, so that the runtime (which reads
``serialize.reader`` only) never loads the writer."""

from ..lazy import lazy_exports

_EXPORTS = {"ProgramFile": "reader", "load_program": "reader", "save_program": "writer"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
