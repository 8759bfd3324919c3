"""The I/O side: reading expert byte ranges from the checkpoint into device buffers."""

from edge0.io_sched.reader import ExpertReader, ReadStats

__all__ = ["ExpertReader", "ReadStats"]
