"""Every error Edge0 raises on purpose.

Edge0Error
 +-- ConfigError              a bad config.json, EngineConfig value or CLI flag
 |    +-- UnsupportedModelError   model_type Edge0 cannot stream
 |    +-- PackagedModelError      a command would write into the demo model the package ships
 +-- CheckpointError          a checkpoint file or directory is malformed
 |    +-- HeaderError             a safetensors header is invalid (names file, tensor)
 |    +-- LayoutError             tensors disagree with config.json or each other
 |    +-- UnsafeModelError        the directory asks to run code, holds pickles, or a file that
 |    |                            is not a regular file inside it (FIFO, device, outside link)
 |    +-- TokenizerError          the tokenizer files do not load
 |    +-- ForeignArtifactError    heads or an adapter made for another base checkpoint
 +-- ExpertReadError          reading an expert's byte range failed while serving
 +-- RoutingError             a step routed in a way its plan cannot serve
 |    +-- RoutingMismatchError    a staged layer routed to an expert its plan did not stage
 +-- SchedulerError           the prefetch scheduler was asked for a plan it does not hold,
 |                            a layer it has no slots for, or is not running
 +-- EngineClosedError        a call on an engine after ``close()``
 +-- EngineBusyError          ``Engine.admit``: too many requests already wait
 +-- StalledConsumerError     a generation's consumer took nothing for its stall timeout
 +-- ConstraintError          a constrained generation's grammar refused a sampled token, or
 |    |                       its processor was fed another generation's tokens
 |    +-- FormatTooCostlyError    one token's mask took longer than the bound (the format's fault)
 +-- KernelError              Edge0's kernels were handed inputs they cannot compute (shape,
 |                            dtype, bits, group size)
 +-- BenchArmError            a benchmark arm's process failed: its exit status or signal, its
                              last words, and what to do about a crash

Each error carries the offending file / tensor / parameter as attributes and names them
in its message, so a test (or a user) can see what was wrong without a traceback.
"""

from __future__ import annotations

from pathlib import Path


class Edge0Error(Exception):
    """Base class of every error Edge0 raises on purpose."""


class ConfigError(Edge0Error, ValueError):
    """A configuration value (config.json, EngineConfig, CLI flag) is invalid."""


class UnsupportedModelError(ConfigError):
    """config.json names a model_type Edge0 has no MoE spec for."""


class PackagedModelError(ConfigError):
    """A command would write into the demo model that ships inside the installed package
    (heads, an adapter, a routing trace beside it): train on a copy of it instead."""


class CheckpointError(Edge0Error):
    """A checkpoint is malformed; names the file and, where known, the tensor."""

    def __init__(self, message: str, *, file: str | Path | None = None, tensor: str | None = None):
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        where = []
        if self.file is not None:
            where.append(f"file {self.file}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        prefix = (", ".join(where) + ": ") if where else ""
        super().__init__(prefix + message)
        self.reason = message


class HeaderError(CheckpointError):
    """A safetensors header is invalid (raised before any tensor data is read)."""


class LayoutError(CheckpointError):
    """Tensors are inconsistent with config.json or with each other."""


class UnsafeModelError(CheckpointError):
    """The model directory asks Edge0 to execute code or load pickles."""


class TokenizerError(CheckpointError):
    """The model directory's tokenizer files do not load."""


class ForeignArtifactError(CheckpointError):
    """A heads or adapter file was made for another base checkpoint (or other heads)."""


class ExpertReadError(Edge0Error, OSError):
    """Reading an expert's byte range from disk failed or came back short."""

    def __init__(self, message: str, *, file: str | Path | None = None, tensor: str | None = None,
                 layer: int | None = None, expert: int | None = None):
        self.file = str(file) if file is not None else None
        self.tensor = tensor
        self.layer = layer
        self.expert = expert
        parts = [p for p in (
            f"file {self.file}" if self.file else None,
            f"tensor {tensor!r}" if tensor else None,
            f"layer {layer}" if layer is not None else None,
            f"expert {expert}" if expert is not None else None,
        ) if p]
        super().__init__((", ".join(parts) + ": " if parts else "") + message)
        self.reason = message


class RoutingError(Edge0Error):
    """A decode step's routing does not fit its plan."""


class RoutingMismatchError(RoutingError):
    """A staged layer routed to an expert its plan did not stage (the step's output is not
    returned: a wrong routing source, e.g. an oracle file of another prompt)."""


class SchedulerError(Edge0Error):
    """The scheduler was asked for something it has no plan for, or is closed."""


class EngineClosedError(Edge0Error):
    """The engine was used after ``close()``."""


class EngineBusyError(Edge0Error):
    """``Engine.admit``: ``waiting`` requests already wait, the most ``limit`` allows."""

    def __init__(self, message: str, *, waiting: int, limit: int):
        super().__init__(message)
        self.waiting, self.limit = waiting, limit


class StalledConsumerError(Edge0Error):
    """A generation's consumer took no token for its ``consumer_timeout``: the generation
    was stopped so that it holds the engine no longer."""


class ConstraintError(Edge0Error):
    """Constrained decoding (``response_format``) went wrong while generating: the grammar
    refused a token that was sampled under its own mask, left no token to allow, or a
    processor was fed tokens that are not its generation's (e.g. reused across two)."""


class FormatTooCostlyError(ConstraintError, ValueError):
    """A ``response_format``'s grammar took longer than ``edge0.constrain.MASK_STEP_S`` to
    mask one token while generating: the generation ends there (the request's fault, a 400
    naming ``response_format`` from the server), so that no format holds the batch longer."""


class KernelError(Edge0Error, ValueError):
    """Edge0's kernels were handed inputs they cannot compute; the message names what."""


class DistributedError(Edge0Error):
    """A group of ranks (``mlx.launch``) could not form or lost a rank: the other ranks did
    not connect in time, or joining the group failed."""


class BenchArmError(Edge0Error):
    """A benchmark arm's process failed (``edge0 bench``): ``arm``, ``returncode`` (negative:
    the signal that ended it, as ``subprocess`` reports it) and what it printed last."""

    def __init__(self, message: str, arm: str, returncode: int):
        super().__init__(message)
        self.arm, self.returncode = arm, returncode
