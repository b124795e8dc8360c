"""A block's frozen parameters held quantized on the host and dequantized on the device.

The frozen segment of a block's load buffer is one flat tensor, each parameter a contiguous slice (a *piece*).
``QuantizedSegment.quantize`` packs it at 4 bits (NF4: block-wise 4-bit codes with double-quantized scales,
QLoRA's format) or 8 bits (block-wise absmax int8) into a few plain tensors that live in one byte buffer
(``lazytrain.util.quant_format`` writes the layout down); the load copies those bytes to the GPU and
``dequantize_into`` writes the parameters, in their dtype, into the block's flat parameter views there.

Quantizing goes through torchao, the kept library (pure PyTorch, so it runs on the CPU tests and on any GPU;
bitsandbytes needs its CUDA or CPU binaries): ``NF4Tensor.from_tensor`` for NF4, ``choose_qparams_affine`` /
``quantize_affine`` (symmetric, range -127..127: scale = absmax / 127) for int8.  Dequantizing is written here in
the same arithmetic, so it gives torchao's values bit for bit (the tests check it) while writing straight into the
destination a chunk at a time: torchao's ``NF4Tensor.get_original_weight`` makes several full-size temporaries
(int64 codes, both halves, the stacked result) where this makes two of one range's size (int32 codes, the
looked-up pairs), and needs no torchao on the device side.

Which parameters are quantized is the caller's choice per piece; ``pieces_of`` applies QLoRA's rule
(``quantized_param``): the matrices of linear layers, never norms, biases or embeddings (QLoRA keeps those in
16 bits; they are a small share of a layer: 8 Ki of 202 Mi values in a 7B layer).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..util.quant_format import (
    CHUNK,
    SCALER_BLOCK,
    bytes_per_param,
    check_bits,
    packed_nbytes,
    quantized_param,
    stream_numel,
)
from ..util.quant_format import (
    sections as layout_sections,
)

__all__ = ["Piece", "QuantizedSegment", "quantized_param", "pieces_of", "bytes_per_param", "FORMAT", "VERSION"]

FORMAT = "lazytrain.quantized_segment"
VERSION = 1

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: each section's element dtype (``None``: the segment's parameter dtype)
_SECTION_DTYPE = {"codes4": torch.uint8, "codes8": torch.int8, "scalers": torch.int8, "scales": torch.float32,
                  "factors": None, "means": None, "lut": None, "raw": None}


@dataclass(frozen=True, slots=True)
class Piece:
    """One parameter of the segment: ``numel`` values from element ``offset``, quantized or kept raw."""
    offset: int
    numel: int
    quantized: bool


def pieces_of(params: Iterable[tuple[str, Sequence[int]]]) -> tuple[Piece, ...]:
    """The pieces of a segment that holds these ``(name, shape)`` parameters in this order, QLoRA's rule each."""
    out, offset = [], 0
    for name, shape in params:
        numel = 1
        for d in shape:
            numel *= int(d)
        out.append(Piece(offset, numel, quantized_param(name, shape)))
        offset += numel
    return tuple(out)


def _torchao():
    try:
        from torchao.quantization import NF4Tensor
        from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine
    except ImportError as e:
        raise ImportError(f"a 4- or 8-bit frozen base needs torchao: pip install torchao (lazytrain's 'qlora' extra) "
                          f"({e})") from None
    return NF4Tensor, MappingType, choose_qparams_affine, quantize_affine


class QuantizedSegment:
    """A frozen segment in its packed form: the layout (``pieces``, ``bits``, ``block_size``, ``dtype``) and the
    host tensors, one per section (``host_tensors``).  Build with ``quantize``; read back with ``load``."""

    def __init__(self, *, pieces: tuple[Piece, ...], bits: int, block_size: int, dtype: torch.dtype,
                 tensors: dict[str, torch.Tensor]):
        self.pieces, self.bits, self.block_size, self.dtype = pieces, bits, block_size, dtype
        self.numel = sum(p.numel for p in pieces)
        self._tensors = tensors

    # --- layout -----------------------------------------------------------------------------------
    @property
    def _quantized(self) -> list[Piece]:
        return [p for p in self.pieces if p.quantized and self.bits != 16]

    def sections(self) -> list[tuple[str, int, int]]:
        """``(name, byte offset, byte length)`` of each section of the packed buffer (``util.quant_format``)."""
        q = [p.numel for p in self._quantized]
        raw = self.numel - sum(q)
        return layout_sections(q, raw, self.bits, self.block_size, self.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed buffer: what the pinned host buffer holds and a load copies to the device."""
        q = [p.numel for p in self._quantized]
        return packed_nbytes(q, self.numel - sum(q), self.bits, self.block_size, self.dtype.itemsize)

    def section_dtype(self, name: str) -> torch.dtype:
        """The element dtype of section ``name``."""
        dtype = _SECTION_DTYPE[f"codes{self.bits}" if name == "codes" else name]
        return self.dtype if dtype is None else dtype

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each section as a tensor of its dtype inside ``buffer`` (a flat uint8 tensor of at least ``nbytes``,
        16-byte aligned; host or device): how the device side reads the copied bytes."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < self.nbytes:
            raise ValueError(f"a quantized segment needs a flat uint8 buffer of {self.nbytes} bytes, got "
                             f"{buffer.dtype} of shape {tuple(buffer.shape)}")
        return {name: buffer[offset:offset + nbytes].view(self.section_dtype(name))
                for name, offset, nbytes in self.sections()}

    def host_tensors(self) -> dict[str, torch.Tensor]:
        """The section tensors on the host (codes, scales, ..., raw), in layout order."""
        return dict(self._tensors)

    def copy_into(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Write the sections into ``buffer`` (e.g. a pinned load buffer) and return them viewed there."""
        views = self.views(buffer)
        for name, view in views.items():
            view.copy_(self._tensors[name])
        return views

    # --- quantize ---------------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def quantize(cls, flat: torch.Tensor, bits: int, block_size: int = 64, pieces: Iterable[Piece] | None = None,
                 device: torch.device | str | None = None) -> QuantizedSegment:
        """Pack ``flat`` (1-D, bf16/fp16/fp32) at ``bits`` (4: NF4, 8: int8, 16: as it is) into host tensors.
        ``pieces`` cover it in order (default: one quantized piece, the whole segment).  ``device`` runs torchao's
        quantization there a chunk at a time (NF4's nearest-code search takes ~0.7 s a Mi values on one CPU core,
        a 7B model an hour on a few cores: a GPU does it in seconds)."""
        check_bits(bits, block_size)
        if flat.dim() != 1 or flat.dtype not in _DTYPES.values():
            raise ValueError(f"a frozen segment is a flat bf16, fp16 or fp32 tensor, got {flat.dtype} "
                             f"of shape {tuple(flat.shape)}")
        pieces = (Piece(0, flat.numel(), True),) if pieces is None else tuple(pieces)
        offset = 0
        for p in pieces:
            if p.offset != offset or p.numel <= 0:
                raise ValueError(f"segment pieces must cover it in order without gaps: {p} after {offset} values")
            offset += p.numel
        if offset != flat.numel():
            raise ValueError(f"segment pieces cover {offset} values of {flat.numel()}")
        seg = cls(pieces=pieces, bits=bits, block_size=block_size, dtype=flat.dtype, tensors={})
        raw = [flat[p.offset:p.offset + p.numel] for p in pieces if p not in seg._quantized]
        # zeroed: a section no chunk writes (NF4's table in a segment of raw pieces alone) has the same bytes every run
        tensors = {name: torch.zeros(nbytes // seg.section_dtype(name).itemsize, dtype=seg.section_dtype(name))
                   for name, _, nbytes in seg.sections()}
        if raw:
            torch.cat(raw, out=tensors["raw"])
        if bits != 16:
            stream = seg._stream_chunks(flat, torch.device(device or "cpu"))
            (seg._pack_nf4 if bits == 4 else seg._pack_int8)(stream, tensors)
        seg._tensors = tensors
        return seg

    def _stream_chunks(self, flat: torch.Tensor, device: torch.device) -> Iterable[tuple[int, torch.Tensor]]:
        """``(stream offset, values)`` of each chunk of the padded quantized stream, built a chunk at a time."""
        n = stream_numel([p.numel for p in self._quantized], self.bits, self.block_size)
        ranges = list(self._ranges())
        for start in range(0, n, CHUNK):
            chunk = torch.zeros(min(CHUNK, n - start), dtype=flat.dtype, device=device)
            for s, length, at in ranges:
                lo, hi = max(s, start), min(s + length, start + chunk.numel())
                if lo < hi:
                    chunk[lo - start:hi - start] = flat[at + lo - s:at + hi - s]
            yield start, chunk

    def _ranges(self) -> Iterable[tuple[int, int, int]]:
        """``(stream offset, numel, segment offset)`` of each quantized piece."""
        s = 0
        for p in self._quantized:
            yield s, p.numel, p.offset
            s += -(-p.numel // self.block_size) * self.block_size

    def _pack_nf4(self, stream, tensors: dict[str, torch.Tensor]) -> None:
        nf4_tensor = _torchao()[0]
        bs = self.block_size
        for i, (start, chunk) in enumerate(stream):
            t = nf4_tensor.from_tensor(chunk, bs, SCALER_BLOCK)
            tensors["codes"][start // 2:start // 2 + chunk.numel() // 2] = t.quantized_data
            tensors["scalers"][start // bs:(start + chunk.numel()) // bs] = t.quantized_scalers
            f0 = start // (bs * SCALER_BLOCK)
            tensors["factors"][f0:f0 + t.quantization_factor.numel()] = t.quantization_factor
            tensors["means"][i] = t.scaler_mean
            tensors["lut"].copy_(t.nf4)

    def _pack_int8(self, stream, tensors: dict[str, torch.Tensor]) -> None:
        _, mapping, choose_qparams, quantize = _torchao()
        bs = self.block_size
        for start, chunk in stream:
            scale, zero = choose_qparams(chunk, mapping.SYMMETRIC, (bs,), torch.int8, -127, 127,
                                         scale_dtype=torch.float32)
            tensors["codes"][start:start + chunk.numel()] = quantize(chunk, (bs,), scale, zero, torch.int8, -127, 127)
            tensors["scales"][start // bs:(start + chunk.numel()) // bs] = scale

    # --- dequantize -------------------------------------------------------------------------------
    @torch.no_grad()
    def dequantize_into(self, dst: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Write the segment's parameters into ``dst`` (flat, of the segment's dtype and size, on the device that
        holds ``tensors``: ``views`` of the copied buffer, or ``host_tensors``).  Temporaries: at most two of one
        chunk's size (int32 codes and the looked-up values) and the chunk's block scales."""
        if dst.dim() != 1 or dst.numel() != self.numel or dst.dtype != self.dtype:
            raise ValueError(f"a quantized segment dequantizes into a flat {self.dtype} tensor of {self.numel} "
                             f"values, got {dst.dtype} of shape {tuple(dst.shape)}")
        raw = tensors["raw"]
        at = 0
        for p in self.pieces:
            if p not in self._quantized:
                dst[p.offset:p.offset + p.numel].copy_(raw[at:at + p.numel])
                at += p.numel
        if self.bits == 16:
            return
        ranges = list(self._ranges())
        n = tensors["codes"].numel() * (2 if self.bits == 4 else 1)
        if self.bits == 4:
            lut = tensors["lut"]
            pairs = torch.stack([lut.repeat_interleave(16), lut.repeat(16)], dim=1)  # byte -> (high, low) values
        for i, start in enumerate(range(0, n, CHUNK)):
            end = min(start + CHUNK, n)
            if self.bits == 4:
                scales = self._nf4_scales(tensors, i, start, end)
            for s, length, offset in ranges:
                lo, hi = max(s, start), min(s + length, end)
                if lo >= hi:
                    continue
                out = dst[offset + lo - s:offset + hi - s]
                if self.bits == 4:
                    self._nf4_range(out, tensors["codes"], pairs, scales, lo, hi, start)
                else:
                    self._int8_range(out, tensors, lo, hi)

    def _nf4_scales(self, tensors: dict[str, torch.Tensor], i: int, start: int, end: int) -> torch.Tensor:
        """The chunk's block scales, as torchao's ``NF4Tensor.dequantize_scalers`` computes them."""
        bs = self.block_size
        q = tensors["scalers"][start // bs:end // bs].view(-1, SCALER_BLOCK)
        f0 = start // (bs * SCALER_BLOCK)
        factors = tensors["factors"][f0:f0 + q.shape[0]]
        return (q / factors.unsqueeze(-1)).flatten().to(self.dtype) + tensors["means"][i]

    def _nf4_range(self, out: torch.Tensor, codes: torch.Tensor, pairs: torch.Tensor, scales: torch.Tensor,
                   lo: int, hi: int, start: int) -> None:
        """Stream values ``[lo, hi)`` into ``out``: look each byte's two values up, times its block's scale."""
        bs = self.block_size
        full = -(-(hi - lo) // bs) * bs  # the piece's last block is whole in the stream
        values = torch.index_select(pairs, 0, codes[lo // 2:(lo + full) // 2].int()).view(-1, bs)
        block_scales = scales[(lo - start) // bs:(lo - start + full) // bs].unsqueeze(-1)
        whole = (hi - lo) // bs * bs
        if whole:
            torch.mul(values[:whole // bs], block_scales[:whole // bs], out=out[:whole].view(-1, bs))
        if whole < hi - lo:
            out[whole:].copy_((values[whole // bs:] * block_scales[whole // bs:]).flatten()[:hi - lo - whole])

    def _int8_range(self, out: torch.Tensor, tensors: dict[str, torch.Tensor], lo: int, hi: int) -> None:
        """Stream values ``[lo, hi)`` into ``out``: code times its block's float32 scale, rounded once."""
        bs = self.block_size
        full = -(-(hi - lo) // bs) * bs
        codes = tensors["codes"][lo:lo + full].view(-1, bs)
        scales = tensors["scales"][lo // bs:(lo + full) // bs].unsqueeze(-1)
        whole = (hi - lo) // bs * bs
        if whole:
            torch.mul(codes[:whole // bs], scales[:whole // bs], out=out[:whole].view(-1, bs))
        if whole < hi - lo:
            out[whole:].copy_((codes[whole // bs:] * scales[whole // bs:]).flatten()[:hi - lo - whole])

    def dequantize(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The whole segment dequantized into a new tensor (tests and tools; the runtime uses ``dequantize_into``)."""
        device = torch.device(device or "cpu")
        if device.type == "cpu":
            tensors = self._tensors
        else:
            buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            tensors = self.views(buffer)
            for name, view in tensors.items():
                view.copy_(self._tensors[name])
        dst = torch.empty(self.numel, dtype=self.dtype, device=device)
        self.dequantize_into(dst, tensors)
        return dst

    # --- files ------------------------------------------------------------------------------------
    def header(self) -> dict:
        """The layout as JSON: enough, with the section tensors, to rebuild the segment."""
        return {"format": FORMAT, "version": VERSION, "bits": self.bits, "block_size": self.block_size,
                "scaler_block_size": SCALER_BLOCK, "chunk": CHUNK, "dtype": str(self.dtype).removeprefix("torch."),
                "pieces": [asdict(p) for p in self.pieces]}

    def digest(self) -> str:
        """sha256 of the header and the packed bytes: the quantized base's identity for a checkpoint."""
        h = hashlib.sha256(json.dumps(self.header(), sort_keys=True).encode())
        for name in sorted(self._tensors):
            h.update(name.encode())
            h.update(self._tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def save(self, path: str | Path) -> None:
        """A safetensors file: one tensor a section, the header as the file's metadata."""
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in self._tensors.items()}, str(path),
                  metadata={"lazytrain": json.dumps(self.header())})

    @classmethod
    def from_parts(cls, header: dict, tensors: dict[str, torch.Tensor]) -> QuantizedSegment:
        """Rebuild from ``header()`` and the section tensors; a file of another format or layout is refused."""
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise ValueError(f"not a quantized segment file of this LazyTrain ({FORMAT} version {VERSION}): "
                             f"{header.get('format')!r} version {header.get('version')!r}; quantize the base again")
        if header.get("scaler_block_size") != SCALER_BLOCK or header.get("chunk") != CHUNK:
            raise ValueError("quantized segment written with another chunk layout: quantize the base again")
        seg = cls(pieces=tuple(Piece(**p) for p in header["pieces"]), bits=header["bits"],
                  block_size=header["block_size"], dtype=_DTYPES[header["dtype"]], tensors={})
        expected = {name: nbytes for name, _, nbytes in seg.sections()}
        got = {k: v.numel() * v.element_size() for k, v in tensors.items()}
        if got != expected:
            raise ValueError(f"quantized segment sections do not match its header: {got} vs {expected}")
        seg._tensors = {name: tensors[name] for name in expected}
        return seg

    @classmethod
    def load(cls, path: str | Path) -> QuantizedSegment:
        """Read a file ``save`` wrote."""
        from safetensors import safe_open
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if "lazytrain" not in meta:
            raise ValueError(f"{path} is not a quantized segment file (no lazytrain header)")
        return cls.from_parts(json.loads(meta["lazytrain"]), tensors)
