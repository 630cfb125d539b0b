"""The host copy of a checkpoint's tensors (an arena) that the background writer
(async_writer.py) stages into and its writer processes read from: allocated once and reused, in
shared memory so a writer process reads it without a copy, pinned (registered with CUDA) so
device copies are DMA at full bus speed."""

from __future__ import annotations

from typing import Any

import torch

ALIGN = 64  # bytes; every staged tensor starts at a multiple of this in the arena


def layout_of(tensors: dict[str, Any]) -> dict[str, tuple[int, tuple, torch.dtype]]:
    """name -> (byte offset, shape, dtype) of each tensor in an arena; its size is the end."""
    out, offset = {}, 0
    for name in sorted(tensors):
        t = tensors[name]
        offset += -offset % ALIGN
        out[name] = (offset, tuple(t.shape), t.dtype)
        offset += t.numel() * t.dtype.itemsize
    return out


def arena_size(layout: dict) -> int:
    return max((off + _numel(shape) * dt.itemsize for off, shape, dt in layout.values()),
               default=0)


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def views(arena: torch.Tensor, layout: dict) -> dict[str, torch.Tensor]:
    """Each tensor's view into the arena (a flat uint8 tensor)."""
    out = {}
    for name, (off, shape, dtype) in layout.items():
        n = _numel(shape) * dtype.itemsize
        out[name] = arena[off: off + n].view(dtype).view(shape)
    return out


def _pin(arena: torch.Tensor) -> bool:
    """Page-lock the arena for CUDA (its memory is shared, so pin_memory() would copy it)."""
    if not torch.cuda.is_available() or arena.numel() == 0:
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
        return int(err) == 0
    except (AttributeError, RuntimeError, TypeError):
        return False


def _unpin(arena: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(arena.data_ptr())
    except (AttributeError, RuntimeError, TypeError):
        pass


class Staging:
    """The host copy of one checkpoint's tensors, reused from one checkpoint to the next."""

    def __init__(self, shared: bool):
        self.shared = shared
        self.layout: dict = {}
        self.arena = torch.empty(0, dtype=torch.uint8)
        self.tensors: dict[str, torch.Tensor] = {}
        self.pinned = False
        self.streams: dict[torch.device, Any] = {}
        self.staged_static: set[str] = set()  # static tensors already in this arena

    @property
    def nbytes(self) -> int:
        return self.arena.numel()

    def ensure(self, tensors: dict[str, Any]) -> bool:
        """Room for ``tensors`` (names, shapes, dtypes); True when the arena was (re)made."""
        layout = layout_of(tensors)
        if layout == self.layout:
            return False
        self.close()
        size = arena_size(layout)
        if self.shared:
            # Made in shared memory from the start (share_memory_ would copy a private buffer).
            storage = torch.UntypedStorage._new_shared(size)
            self.arena = torch.empty(0, dtype=torch.uint8).set_(storage)
        else:
            self.arena = torch.empty(size, dtype=torch.uint8)
        self.pinned = _pin(self.arena)
        self.layout, self.tensors = layout, views(self.arena, layout)
        return True

    def stage(self, sources: list[dict[str, torch.Tensor]], owner: dict[str, int],
              static: frozenset = frozenset()) -> None:
        """Copy every tensor into the arena: ``owner[name]`` picks the source (replica) it is
        read from (absent from that source: the first). Tensors named in ``static`` never change
        in a run (DSpark's frozen copies of the target's embedding and lm_head): copied once per
        arena. Returns once all copies are done."""
        used: set[torch.device] = set()
        for name, dst in self.tensors.items():
            if name in self.staged_static:
                continue
            src = sources[owner.get(name, 0) % len(sources)].get(name)
            if src is None:
                src = sources[0][name]
            if src.is_cuda:
                dev = src.device
                side = self.streams.get(dev)
                if side is None:
                    side = self.streams[dev] = torch.cuda.Stream(dev)
                if dev not in used:  # after the optimizer step queued on the device's stream
                    side.wait_stream(torch.cuda.current_stream(dev))
                    used.add(dev)
                with torch.cuda.stream(side):
                    dst.copy_(src, non_blocking=self.pinned)
            else:
                dst.copy_(src)
        for dev in used:
            self.streams[dev].synchronize()
        self.staged_static |= set(static) & set(self.tensors)

    def close(self) -> None:
        if self.pinned:
            _unpin(self.arena)
        self.pinned = False
        self.arena = torch.empty(0, dtype=torch.uint8)
        self.tensors, self.layout = {}, {}
        self.staged_static = set()




def enough_shared_memory(nbytes: int) -> bool:
    """Whether the shared-memory filesystem can hold the arena (containers often give 64 MB)."""
    import shutil
    try:
        return shutil.disk_usage("/dev/shm").free > nbytes * 1.05
    except OSError:
        return False


def stepped_optimizer_state(optimizer) -> dict:
    """An optimizer's state_dict as it will be once it has stepped, its tensors meta (shapes and
    dtypes only): with it the arena is made before the first step, so that step's checkpoint
    only copies. AdamW keeps a step and two moments per parameter; Muon (optim.name: muon, its
    groups first in MuonAdamW's one state dict) a momentum buffer per matrix."""
    def meta(shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    parts = getattr(optimizer, "parts", [optimizer])
    muon = getattr(torch.optim, "Muon", None)
    state, i = {}, 0
    for part in parts:
        for group in part.param_groups:
            for p in group["params"]:
                if muon is not None and isinstance(part, muon):
                    state[i] = {"momentum_buffer": meta(p.shape, p.dtype)}
                else:
                    state[i] = {"step": meta((), torch.float32), "exp_avg": meta(p.shape, p.dtype),
                                "exp_avg_sq": meta(p.shape, p.dtype)}
                i += 1
    return {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}
