"""The vattn exception hierarchy. Every error a caller can cause is one of these."""
from __future__ import annotations


class VattnError(Exception):
    """Base class of every vattn error."""


class FatalEngineError(VattnError):
    """The engine cannot go on (e.g. its tensor-parallel group failed): never retried, never
    turned into a per-request failure; close the engine. The scheduler lets it propagate."""


class InvalidConfigError(VattnError, ValueError):
    """A configuration value is wrong (sizes, dtype, page size, layout, device)."""


class UnsupportedModelError(InvalidConfigError):
    """The model has layers vattn cannot run (state-space, linear-attention, recurrent or
    convolution layers, chunked or sparse attention): refused at load, never served wrong.
    The message names the layers and their kinds."""


class InvalidRequestError(VattnError, ValueError):
    """A call's arguments are wrong (bad seq_lens, bad prompt, ...)."""


class UnknownReqIdError(InvalidRequestError, KeyError):
    """A reqid that is out of range, was never allocated, or was already freed."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownBlockError(InvalidRequestError, KeyError):
    """An elastic pool's block id that is out of range, not allocated (double free), or given twice."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ContextLengthError(InvalidRequestError):
    """A sequence length above max_context_len."""


class NoFreeSlotError(VattnError, RuntimeError):
    """alloc_reqid found every slot busy; free a reqid or raise max_batch_size."""


class OutOfVirtualMemoryError(VattnError, MemoryError):
    """The virtual address space could not be reserved."""


class OutOfPhysicalMemoryError(VattnError, MemoryError):
    """Physical pages could not be created (device or host memory exhausted, or over budget)."""


class MapCountLimitError(VattnError, OSError):
    """The host kernel's per-process mapping limit (vm.max_map_count) was reached."""


class BackendError(VattnError, RuntimeError):
    """A virtual-memory call of the backend failed (names the call and the code)."""

    def __init__(self, call: str, code: int, name: str, hint: str = "") -> None:
        self.call, self.code, self.name = call, code, name
        msg = f"{call} failed with {name} ({code})"
        super().__init__(msg + (f": {hint}" if hint else ""))


class NotInitializedError(VattnError, RuntimeError):
    """A module-level function was called before vattn.init()."""


class ClosedError(VattnError, RuntimeError):
    """The cache was closed; create a new one with vattn.init()."""


class TensorParallelError(FatalEngineError, RuntimeError):
    """Tensor-parallel ranks could not go on together: a rank raised or exited, a collective
    timed out, or the ranks were given different requests. The engine cannot be used again;
    close it (and restart every rank)."""


class RankCacheError(VattnError, RuntimeError):
    """A KV cache `step` raised on some rank (a backend failure): every rank raises this, with
    the same message, so that the scheduler requeues the same requests everywhere."""


class UnsupportedLayoutError(VattnError, ValueError):
    """This vLLM KV cache configuration cannot be put on vattn memory (vLLM keeps its own)."""


class TooFewBlocksError(UnsupportedLayoutError):
    """A layer-outer vLLM KV cache whose blocks do not fill one whole-page run a layer
    (`vattn.integrations.vllm.layout.page_run_blocks`): vattn cannot back it without promising
    memory vLLM did not measure. A worker keeps vLLM's memory for it; EngineCore's `start`
    refuses it (InvalidConfigError, naming the page size and block count that work)."""


class OpsOutOfOrderError(VattnError, RuntimeError):
    """A vLLM worker got page operations out of sequence: its pages no longer match the books."""


class HookError(VattnError, RuntimeError):
    """A plugin's hunk does not fit the installed engine (another release, a local change, a
    patch already applied on disk): the plugin installs nothing."""


class UnsafeTableError(InvalidConfigError):
    """A file where a shared budget's table goes that vattn will not open as one: not a
    regular file, or not made for this user (or for the directory's group). `path` is the
    file, `why` what is wrong in a few words (`vattn top` shows it), `st` its `os.stat`."""

    def __init__(self, message: str, *, path: object = None, why: str = "", st: object = None) -> None:
        super().__init__(message)
        self.path, self.why, self.st = path, why, st


class UnsafeOffloadDirError(InvalidConfigError):
    """An `offload_dir` (or a directory vattn made under it) that another user could write:
    not a directory, a link, owned by someone else, or writable by its group (without the
    set-group-ID bit that shares it on purpose) or by everyone. Blocks read from there could
    be another user's K/V, served as this model's: refused at start. `path` is the directory,
    `why` what is wrong, `st` its `os.stat` (or None). See docs/shared-pages.md."""

    def __init__(self, message: str, *, path: object = None, why: str = "", st: object = None) -> None:
        super().__init__(message)
        self.path, self.why, self.st = path, why, st


class DamagedTableError(InvalidRequestError):
    """The table of a shared budget this process is a member of was changed under it by
    another process (cut short, its row cleared or taken), or its books stayed locked:
    takes are refused; close the caches on the budget and join it again (leaving works)."""
