"""Adam's two moments in the state dtype a plan asks for (`optimizer.state_dtype`).

'fp32' keeps both moments in float32 (8 bytes a parameter), 'bf16' in bfloat16 (4: the kernel
computes in fp32 and stores rounded to nearest even), '8bit' as bitsandbytes' blockwise
dynamic quantisation (2, and one fp32 absmax per QUANT_BLOCK values: about 2.03). The fp32
master stays fp32 in every case.

An 8-bit moment's blocks start at its own parameter's first element, as bitsandbytes' blocks
start at each tensor's: a parameter's update depends on nothing but its own values, so a run
over several parameters, another rank's chunk layout or a resumed run gives the same bytes.
The absmax values of a chunk's parameters lie one after another in slot order, so parameters
that fill whole blocks are one kernel call (`joins`).

`AdamMoments` is the one place that knows a format: the bytes it takes, how a buffer holds a
chunk's moments (each parameter's state being views into it), one update of a run (the C++
kernel, or torch ops where the moments are on an accelerator) and the values to and from a
state dict. A tier that keeps the moments elsewhere gives it buffers; nothing else changes.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from fxstar import _C
from fxstar.runtime import cpu_adam
from fxstar.runtime.host import host_empty

__all__ = [
    "MOMENT_KEYS", "QUANT_BLOCK", "STATE_DTYPES", "AdamMoments", "moment_bytes", "quant_blocks",
]  # fmt: skip

STATE_DTYPES = ("fp32", "bf16", "8bit")
QUANT_BLOCK: int = _C.QUANT_BLOCK  # values per fp32 absmax of an 8-bit moment
VALUES = ("exp_avg", "exp_avg_sq")  # fp32 and bf16 moments: a tensor of its parameter's shape
# 8-bit moments: uint8 codes of the parameter's shape and an fp32 absmax per block
CODES = ("exp_avg_codes", "exp_avg_sq_codes")
ABSMAX = ("exp_avg_absmax", "exp_avg_sq_absmax")
MOMENT_KEYS = (*VALUES, *CODES, *ABSMAX)  # a state entry's moments, in any format
PIECE = 1 << 20  # elements an accelerator updates at once: its fp32 temporaries stay small
CODES_ALIGNMENT = 64  # bytes: the absmax after a chunk's codes starts on a cache line


class Slot(Protocol):
    """Where a parameter lies in its chunk (layout.ParamSlot)."""

    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int: ...


def quant_blocks(numel: int) -> int:
    """The absmax values of an 8-bit moment of `numel` values."""
    return -(-numel // QUANT_BLOCK)


def _check_state_dtype(state_dtype: str) -> str:
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype: one of {', '.join(STATE_DTYPES)}, not {state_dtype!r}")
    return state_dtype


def moment_bytes(state_dtype: str, length: int, numels: Sequence[int], align: int = 1) -> int:
    """Bytes of both moments of a chunk whose parameters (of `numels` elements, in slot order)
    span `length` elements: the buffer `AdamMoments.views` lays them out in, each region
    starting at a multiple of `align` bytes."""
    regions = _regions(_check_state_dtype(state_dtype), length, numels, align)
    return regions[-1][0] + regions[-1][1]


def _regions(state_dtype: str, length: int, numels: Sequence[int], align: int
             ) -> list[tuple[int, int]]:  # fmt: skip
    """(offset, bytes) of a chunk's moment regions, in order: both moments' values; or both
    moments' codes, then both moments' absmax values."""
    if state_dtype != "8bit":
        size = length * (4 if state_dtype == "fp32" else 2)
        return [(0, size), (_up(size, align), size)]
    codes = _up(length, max(CODES_ALIGNMENT, align))
    scales = 4 * sum(map(quant_blocks, numels))
    return [
        (0, length),
        (codes, length),
        (2 * codes, scales),
        (2 * codes + _up(scales, align), scales),
    ]


def _up(n: int, align: int) -> int:
    return -(-n // align) * align


class AdamMoments:
    """Both Adam moments in one state dtype (see the module)."""

    def __init__(self, state_dtype: str = "fp32", *, align: int = 1):
        self.state_dtype = _check_state_dtype(state_dtype)
        self.quantised = state_dtype == "8bit"
        self.align = align  # bytes: where each region of a chunk's layout starts (a disk page)
        # the per-parameter state keys, in the order a run hands them to the kernel
        self.keys = (CODES[0], ABSMAX[0], CODES[1], ABSMAX[1]) if self.quantised else VALUES

    def nbytes(self, length: int, numels: Sequence[int]) -> int:
        return moment_bytes(self.state_dtype, length, numels, self.align)

    def bytes_per_element(self) -> float:
        """Bytes both moments take per parameter element (8-bit: its absmax shared by a
        whole block)."""
        return {"fp32": 8.0, "bf16": 4.0, "8bit": 2.0 + 8.0 / QUANT_BLOCK}[self.state_dtype]

    def regions(self, length: int, numels: Sequence[int]) -> list[tuple[int, int]]:
        """(offset, bytes) of each region of `views`' layout: the values of both moments, or
        the codes of both and the absmax values of both."""
        return _regions(self.state_dtype, length, numels, self.align)

    def views(self, buffer: torch.Tensor, length: int, slots: Sequence[Slot]
              ) -> list[dict[str, torch.Tensor]]:  # fmt: skip
        """Each slot's moments inside `buffer` (uint8, `nbytes(length, ...)` of a chunk whose
        slots span `length` elements, zeroed: zero moments), as its state's entries."""
        regions = [buffer[o : o + n] for o, n in self.regions(length, [s.numel for s in slots])]
        if not self.quantised:
            dtype = torch.float32 if self.state_dtype == "fp32" else torch.bfloat16
            first, second = (r.view(dtype) for r in regions)
            return [{VALUES[0]: first[s.offset : s.offset + s.numel].view(s.shape),
                     VALUES[1]: second[s.offset : s.offset + s.numel].view(s.shape)}
                    for s in slots]  # fmt: skip
        first = (regions[0], regions[2].view(torch.float32))
        second = (regions[1], regions[3].view(torch.float32))
        views, block = [], 0
        for s in slots:
            elements = slice(s.offset, s.offset + s.numel)
            own = slice(block, block + quant_blocks(s.numel))
            views.append({
                CODES[0]: first[0][elements].view(s.shape), ABSMAX[0]: first[1][own],
                CODES[1]: second[0][elements].view(s.shape), ABSMAX[1]: second[1][own],
            })  # fmt: skip
            block = own.stop
        return views

    def on_host(self, length: int, slots: Sequence[Slot]) -> list[dict[str, torch.Tensor]]:
        """Zero moments of a chunk's slots in a host buffer of their own (`views`)."""
        numels = [s.numel for s in slots]
        return self.views(host_empty(self.nbytes(length, numels), zero=True), length, slots)

    def fresh(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero moments of one tensor's own, where `param` is (a parameter outside the
        chunks)."""
        if self.state_dtype == "fp32":
            return {key: torch.zeros_like(param, memory_format=torch.contiguous_format)
                    for key in VALUES}  # fmt: skip
        buffer = torch.zeros(self.nbytes(param.numel(), [param.numel()]), dtype=torch.uint8,
                             device=param.device)  # fmt: skip
        return self.views(buffer, param.numel(), [_Whole(tuple(param.shape))])[0]

    def joins(self, numel: int) -> bool:
        """Whether a run of one kernel call may go on past a parameter of `numel` elements: an
        8-bit moment's blocks must start at each parameter's first element."""
        return not self.quantised or numel % QUANT_BLOCK == 0

    def run(self, state: Mapping[str, torch.Tensor], numel: int) -> tuple[torch.Tensor, ...]:
        """The moments of `numel` elements starting at `state`'s parameter (a run of
        parameters adjacent in their chunk, their moments contiguous beyond the first's own
        views), in the kernel's order."""
        lengths = {CODES[0]: numel, CODES[1]: numel, ABSMAX[0]: quant_blocks(numel),
                   ABSMAX[1]: quant_blocks(numel), VALUES[0]: numel, VALUES[1]: numel}  # fmt: skip
        return tuple(_extend(state[key], lengths[key]) for key in self.keys)

    def step(self, param: torch.Tensor, grad: torch.Tensor, moments: Sequence[torch.Tensor],
             **hyper: Any) -> None:  # fmt: skip
        """One update of host tensors by the C++ kernel (cpu_adam.adam_step's arguments)."""
        if self.quantised:
            cpu_adam.adam_step_8bit(param, grad, *moments, **hyper)
        else:
            cpu_adam.adam_step(param, grad, *moments, **hyper)

    def torch_step(self, param: torch.Tensor, grad: torch.Tensor,
                   moments: Sequence[torch.Tensor], step: torch.Tensor, *, lr: float,
                   betas: tuple[float, float], eps: float, weight_decay: float,
                   adamw: bool) -> None:  # fmt: skip
        """One update by torch's fused Adam where the tensors are (an accelerator): fp32
        moments in place; bf16 or 8-bit ones widened to fp32 a piece at a time and stored
        back as the C++ kernel stores them. `grad` is fp32 and unscaled."""
        fused = torch._fused_adamw_ if adamw else torch._fused_adam_

        def update(p, g, m, v) -> None:
            fused([p], [g], [m], [v], [], [step.to(p.device)], lr=lr, beta1=betas[0],
                  beta2=betas[1], weight_decay=weight_decay, eps=eps, amsgrad=False,
                  maximize=False)  # fmt: skip

        if self.state_dtype == "fp32":
            update(param, grad, *moments)
            return
        for lo in range(0, param.numel(), PIECE):  # PIECE is a whole number of blocks
            part = slice(lo, lo + PIECE)
            p, g = param[part], grad[part]
            if self.quantised:
                m_codes, m_absmax, v_codes, v_absmax = moments
                blocks = slice(lo // QUANT_BLOCK, quant_blocks(lo + p.numel()))
                m = dequantize(m_codes[part], m_absmax[blocks], signed=True)
                v = dequantize(v_codes[part], v_absmax[blocks], signed=False)
                update(p, g, m, v)
                quantize(m, m_codes[part], m_absmax[blocks], signed=True)
                quantize(v, v_codes[part], v_absmax[blocks], signed=False)
            else:
                m, v = moments[0][part].float(), moments[1][part].float()
                update(p, g, m, v)
                moments[0][part].copy_(m)  # rounded to nearest even
                moments[1][part].copy_(v)

    def values(self, state: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Both moments of a state entry (of any format) as fp32 tensors of their own."""
        if CODES[0] in state:
            first = dequantize(state[CODES[0]].reshape(-1), state[ABSMAX[0]], signed=True)
            second = dequantize(state[CODES[1]].reshape(-1), state[ABSMAX[1]], signed=False)
            return first, second
        return state[VALUES[0]].reshape(-1).float(), state[VALUES[1]].reshape(-1).float()

    def load(self, state: Mapping[str, torch.Tensor], saved: Mapping[str, Any]) -> None:
        """A saved state's moments into `state`'s own tensors. Saved in this format, copied as
        they are (bitwise); in another, converted: to fp32 values, then stored as this format
        stores them (rounded to bf16, or quantised)."""
        if all(key in saved for key in self.keys):
            for key in self.keys:
                state[key].copy_(saved[key])
            return
        if not any(key in saved for key in (*VALUES, *CODES)):
            raise KeyError(f"no Adam moments among the saved state's {sorted(saved)}")
        first, second = self.values(saved)
        if not self.quantised:
            state[VALUES[0]].copy_(first.view_as(state[VALUES[0]]))
            state[VALUES[1]].copy_(second.view_as(state[VALUES[1]]))
            return
        device = state[CODES[0]].device
        for codes, absmax, values, signed in zip(CODES, ABSMAX, (first, second), (True, False)):
            values = values.to(device).contiguous()
            quantize(values, state[codes].view(-1), state[absmax], signed=signed)


class _Whole:
    """A parameter alone: one slot at offset 0."""

    def __init__(self, shape: tuple[int, ...]):
        self.offset, self.shape = 0, shape

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def _extend(view: torch.Tensor, n: int) -> torch.Tensor:
    """The n elements starting at `view`'s first: the moments of a run are contiguous in their
    chunk, beyond the first parameter's own view."""
    return view.as_strided((n,), (1,), view.storage_offset())


@functools.cache
def _codes(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The 256 values of an 8-bit moment's codes and the 255 midpoints between them, as the
    C++ core has them (csrc/kernels/quant_map.hpp)."""
    code = torch.tensor(_C.quantization_map(signed=signed), dtype=torch.float32)
    return code.to(device), ((code[:-1] + code[1:]) * 0.5).to(device)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool) -> torch.Tensor:
    """fp32 values of a flat 8-bit moment: each code's map value times its block's absmax."""
    if codes.device.type == "cpu":
        out = torch.empty(codes.numel(), dtype=torch.float32)
        _C.dequantize_moment(codes, absmax, out, signed=signed)
        return out
    code, _ = _codes(signed, codes.device)
    return code[codes.long()] * absmax.repeat_interleave(QUANT_BLOCK)[: codes.numel()]


def quantize(values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, *,
             signed: bool) -> None:  # fmt: skip
    """codes, absmax <- flat fp32 `values`, quantised blockwise to the nearest code (the
    C++ core on the host; the same rule in torch ops elsewhere)."""
    if values.device.type == "cpu":
        _C.quantize_moment(values, codes, absmax, signed=signed)
        return
    torch_quantize(values, codes, absmax, signed=signed)


def torch_quantize(values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, *,
                   signed: bool) -> None:  # fmt: skip
    """`quantize` in torch ops, as the C++ core computes it: the count of midpoints below
    value / absmax (a tie to the lower code), a first moment's sign kept."""
    n = values.numel()
    blocks = torch.nn.functional.pad(values.abs(), (0, -n % QUANT_BLOCK)).view(-1, QUANT_BLOCK)
    largest = blocks.amax(dim=1)
    absmax.copy_(largest)
    divisor = torch.where(largest > 0, largest, torch.ones_like(largest))
    scaled = values / divisor.repeat_interleave(QUANT_BLOCK)[:n]
    code, mid = _codes(signed, values.device)
    index = torch.searchsorted(mid, scaled)
    if signed:
        index = index - ((scaled < 0) & (code[index] >= 0)).long()
        index = index + ((scaled > 0) & (code[index] < 0)).long()
    codes.copy_(index.to(torch.uint8))
