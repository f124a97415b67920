"""Block-diagonal curvature ``H`` eigendecomposed once, and the Gaussian ``N(0, P⁻¹)``, ``P = H/T + δ``.

``H`` is block-diagonal over groups ``g`` of parameter tensors (one tensor per block, except the full
GGN, one block over every tensor), and every block is held in eigen form, in float64. For each block,
``log det P_g``; the sample ``Δ ~ N(0, P_g⁻¹)`` from ``z ~ N(0, I)``; and ``diag P_g⁻¹``:

* diagonal ``h``: ``Σ log(h/T+δ)``; ``z / √(h/T+δ)``; ``1/(h/T+δ)``;
* Kronecker ``B⊗A``: ``Σ_ik log(b_i a_k/T+δ)``; ``U_B [Z ⊘ √(b aᵀ/T+δ)] U_Aᵀ``;
  ``(U_B∘U_B)[1/(baᵀ/T+δ)](U_A∘U_A)ᵀ``;
* dense ``Q diag λ Qᵀ``: ``Σ log(λ/T+δ)``; ``Q[(Qᵀz) / √(λ/T+δ)]``; ``(Q∘Q)(1/(λ/T+δ))``;
* low rank ``V diag λ Vᵀ``: ``(d−r) log δ + Σ log(λ/T+δ)``; ``(z−VVᵀz)/√δ + V[(Vᵀz)/√(λ/T+δ)]``;
  ``(1−Σ_r V²)/δ + Σ_r V²/(λ/T+δ)``;

with ``B = U_B diag b U_Bᵀ``, ``A = U_A diag a U_Aᵀ`` (the eigenvalues of ``B⊗A`` are the products ``b_i a_k`` with
eigenvectors ``u_i ⊗ v_k``; Martens & Grosse 2015, §6.3), ``V`` orthonormal ``d×r`` (the dual form of Khan et al. 2019:
``H = WᵀW``, ``WWᵀ = U diag λ Uᵀ``, ``V = WᵀUλ^{−1/2}``). A Kronecker block of a weight ``W ∈ R^{out×in}`` (a
convolution's ``in = C_in·k_h·k_w``) acts on ``W`` flattened row major, so ``(B⊗A) vec W = vec(B W A)``. The functional
variance ``diag(J P⁻¹ Jᵀ)`` of per-example Jacobians uses the same pieces: ``Σ J²/(h/T+δ)``,
``Σ_ik (U_Bᵀ J U_A)²_ik/(b_i a_k/T+δ)``, ``Σ (JQ)²/(λ/T+δ)`` and ``(‖J‖² − ‖JV‖²)/δ + Σ (JV)²/(λ/T+δ)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from flatbma.checks import is_number
from flatbma.errors import FlatbmaError
from flatbma.gaussian import standard_normal_like
from flatbma.types import Params

__all__ = [
    "Blocks",
    "DenseBlock",
    "DiagBlock",
    "KronBlock",
    "LowRankBlock",
    "Precision",
    "check_temperature",
    "symmetric_eigh",
]

Precision = Mapping[str, float] | float
"""The prior precision ``δ``: one value per block name, or one number for every block."""

F64 = torch.float64


def symmetric_eigh(matrix: Tensor) -> tuple[Tensor, Tensor]:
    """``(λ, Q)`` of ``(M + Mᵀ)/2`` in float64, with round-off negative eigenvalues clamped to 0."""
    m = matrix.to(F64)
    lam, q = torch.linalg.eigh(0.5 * (m + m.mT))
    return lam.clamp_min(0.0), q


def _flat(tensors: Mapping[str, Tensor], names: tuple[str, ...], lead: int) -> Tensor:
    """``[*lead dims, Σ numel]`` float64, tensors of ``names`` concatenated in that order."""
    first = tensors[names[0]]
    head = first.shape[:lead]
    return torch.cat([tensors[n].to(F64).reshape(*head, -1) for n in names], dim=-1)


def _split(flat: Tensor, names: tuple[str, ...], shapes: tuple[torch.Size, ...]) -> Params:
    pieces = flat.split([s.numel() for s in shapes], dim=-1)
    head = flat.shape[:-1]
    return {n: p.reshape(*head, *s) for n, p, s in zip(names, pieces, shapes, strict=True)}


@dataclass(frozen=True)
class DiagBlock:
    """One tensor with a diagonal curvature ``h`` (shape of the tensor, float64, ``h ≥ 0``)."""

    names: tuple[str, ...]
    h: Tensor

    @property
    def dim(self) -> int:
        """Number of scalar parameters ``d_g``."""
        return self.h.numel()

    def eigenvalues(self) -> Tensor:
        """Eigenvalues of ``H_g`` (float64; a low-rank block: its ``r`` nonzero ones)."""
        return self.h.reshape(-1)

    def logdet(self, delta: float, t: float) -> float:
        """``log det(H_g/T + δ I)``."""
        return float(torch.log(self.h / t + delta).sum())

    def scale(self, z: Params, delta: float, t: float) -> Params:
        """``S z`` with ``S Sᵀ = (H_g/T + δ I)⁻¹``, by parameter name (float64)."""
        return {self.names[0]: z[self.names[0]] / torch.sqrt(self.h / t + delta)}

    def marginal_variance(self, delta: float, t: float) -> Params:
        """``diag (H_g/T + δ I)⁻¹`` by parameter name."""
        return {self.names[0]: 1.0 / (self.h / t + delta)}

    def functional_variance(self, jac: Params, delta: float, t: float) -> Tensor:
        """``diag(J_g (H_g/T + δ I)⁻¹ J_gᵀ)`` ``[B, C]`` from ``J`` ``{name: [B, C, *shape]}``."""
        j = jac[self.names[0]].to(F64)
        s = (self.h / t + delta).reshape(-1)
        return (j.reshape(*j.shape[:2], -1).square() / s).sum(-1)


@dataclass(frozen=True)
class KronBlock:
    """One weight ``[out, *in]`` with curvature ``B ⊗ A`` (``B`` out×out, ``A`` in'×in'), eigendecomposed."""

    names: tuple[str, ...]
    shape: torch.Size
    b: Tensor
    u_b: Tensor
    a: Tensor
    u_a: Tensor

    @property
    def dim(self) -> int:
        """Number of scalar parameters ``d_g``."""
        return self.b.numel() * self.a.numel()

    def _precision(self, delta: float, t: float) -> Tensor:
        return torch.outer(self.b, self.a) / t + delta

    def eigenvalues(self) -> Tensor:
        """Eigenvalues of ``H_g`` (float64; a low-rank block: its ``r`` nonzero ones)."""
        return torch.outer(self.b, self.a).reshape(-1)

    def logdet(self, delta: float, t: float) -> float:
        """``log det(H_g/T + δ I)``."""
        return float(torch.log(self._precision(delta, t)).sum())

    def scale(self, z: Params, delta: float, t: float) -> Params:
        """``S z`` with ``S Sᵀ = (H_g/T + δ I)⁻¹``, by parameter name (float64)."""
        zm = z[self.names[0]].to(F64).reshape(self.b.numel(), self.a.numel())
        out = self.u_b @ (zm / torch.sqrt(self._precision(delta, t))) @ self.u_a.mT
        return {self.names[0]: out.reshape(self.shape)}

    def marginal_variance(self, delta: float, t: float) -> Params:
        """``diag (H_g/T + δ I)⁻¹`` by parameter name."""
        v = self.u_b.square() @ (1.0 / self._precision(delta, t)) @ self.u_a.square().mT
        return {self.names[0]: v.reshape(self.shape)}

    def functional_variance(self, jac: Params, delta: float, t: float) -> Tensor:
        """``diag(J_g (H_g/T + δ I)⁻¹ J_gᵀ)`` ``[B, C]`` from ``J`` ``{name: [B, C, *shape]}``."""
        j = jac[self.names[0]].to(F64)
        j = j.reshape(*j.shape[:2], self.b.numel(), self.a.numel())
        rotated = self.u_b.mT @ j @ self.u_a
        return (rotated.square() / self._precision(delta, t)).sum((-2, -1))


@dataclass(frozen=True)
class DenseBlock:
    """Tensors ``names`` (flattened and concatenated in that order) with a dense curvature ``Q diag λ Qᵀ``."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    lam: Tensor
    q: Tensor

    @property
    def dim(self) -> int:
        """Number of scalar parameters ``d_g``."""
        return self.lam.numel()

    def eigenvalues(self) -> Tensor:
        """Eigenvalues of ``H_g`` (float64; a low-rank block: its ``r`` nonzero ones)."""
        return self.lam

    def logdet(self, delta: float, t: float) -> float:
        """``log det(H_g/T + δ I)``."""
        return float(torch.log(self.lam / t + delta).sum())

    def scale(self, z: Params, delta: float, t: float) -> Params:
        """``S z`` with ``S Sᵀ = (H_g/T + δ I)⁻¹``, by parameter name (float64)."""
        zf = _flat(z, self.names, 0)
        return _split(self.q @ ((self.q.mT @ zf) / torch.sqrt(self.lam / t + delta)), self.names, self.shapes)

    def marginal_variance(self, delta: float, t: float) -> Params:
        """``diag (H_g/T + δ I)⁻¹`` by parameter name."""
        return _split(self.q.square() @ (1.0 / (self.lam / t + delta)), self.names, self.shapes)

    def functional_variance(self, jac: Params, delta: float, t: float) -> Tensor:
        """``diag(J_g (H_g/T + δ I)⁻¹ J_gᵀ)`` ``[B, C]`` from ``J`` ``{name: [B, C, *shape]}``."""
        jq = _flat(jac, self.names, 2) @ self.q
        return (jq.square() / (self.lam / t + delta)).sum(-1)


@dataclass(frozen=True)
class LowRankBlock:
    """Tensors ``names`` with curvature ``V diag λ Vᵀ`` of rank ``r`` (``V`` orthonormal ``[d, r]``)."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    lam: Tensor
    v: Tensor

    @property
    def dim(self) -> int:
        """Number of scalar parameters ``d_g``."""
        return self.v.shape[0]

    def eigenvalues(self) -> Tensor:
        """Eigenvalues of ``H_g`` (float64; a low-rank block: its ``r`` nonzero ones)."""
        return self.lam

    def logdet(self, delta: float, t: float) -> float:
        """``log det(H_g/T + δ I)``."""
        zeros = self.dim - self.lam.numel()
        return float(torch.log(self.lam / t + delta).sum()) + zeros * math.log(delta)

    def scale(self, z: Params, delta: float, t: float) -> Params:
        """``S z`` with ``S Sᵀ = (H_g/T + δ I)⁻¹``, by parameter name (float64)."""
        zf = _flat(z, self.names, 0)
        c = self.v.mT @ zf
        out = (zf - self.v @ c) / math.sqrt(delta) + self.v @ (c / torch.sqrt(self.lam / t + delta))
        return _split(out, self.names, self.shapes)

    def marginal_variance(self, delta: float, t: float) -> Params:
        """``diag (H_g/T + δ I)⁻¹`` by parameter name."""
        v2 = self.v.square()
        out = (1.0 - v2.sum(-1)) / delta + v2 @ (1.0 / (self.lam / t + delta))
        return _split(out, self.names, self.shapes)

    def functional_variance(self, jac: Params, delta: float, t: float) -> Tensor:
        """``diag(J_g (H_g/T + δ I)⁻¹ J_gᵀ)`` ``[B, C]`` from ``J`` ``{name: [B, C, *shape]}``."""
        j = _flat(jac, self.names, 2)
        jv = j @ self.v
        outside = (j.square().sum(-1) - jv.square().sum(-1)).clamp_min(0.0)
        return outside / delta + (jv.square() / (self.lam / t + delta)).sum(-1)


Block = DiagBlock | KronBlock | DenseBlock | LowRankBlock


class Blocks:
    """``H``'s block-diagonal structure, eigendecomposed (float64), and the Gaussian ``N(0, (H/T + δ)⁻¹)``.

    Built by :meth:`flatbma.curvature.Estimator.blocks`. Each block has its own ``δ_g`` (a mapping from
    block name to value, or one number for all). Results by parameter name come back in the parameters'
    dtypes; scalars as Python floats.

    Attributes:
        names: block names, sorted (one per parameter tensor; the full GGN: one block ``"full"``).
        dtypes: parameter name -> dtype of the parameter (the dtype of samples and variances).
    """

    def __init__(self, blocks: Mapping[str, Block], dtypes: Mapping[str, torch.dtype]) -> None:
        self._blocks = dict(sorted(blocks.items()))
        self.names: tuple[str, ...] = tuple(self._blocks)
        self.dtypes = dict(sorted(dtypes.items()))
        self._shapes = {}
        for block in self._blocks.values():
            for name, shape in zip(block.names, _shapes_of(block), strict=True):
                self._shapes[name] = shape
        self._device = next(iter(self._blocks.values())).eigenvalues().device

    def __repr__(self) -> str:
        kinds = {type(b).__name__ for b in self._blocks.values()}
        return f"Blocks({len(self.names)} blocks: {', '.join(sorted(kinds))}; d = {sum(self.dims().values())})"

    def block(self, name: str) -> Block:
        """The block ``name`` (:class:`DiagBlock`, :class:`KronBlock`, :class:`DenseBlock` or :class:`LowRankBlock`)."""
        return self._blocks[name]

    def params_of(self, block: str) -> tuple[str, ...]:
        """Parameter names of ``block``."""
        return self._blocks[block].names

    def eigenvalues(self, block: str) -> Tensor:
        """Eigenvalues ``λ ≥ 0`` of ``H_g`` (float64); a low-rank block lists its ``r`` nonzero ones only."""
        return self._blocks[block].eigenvalues()

    def dim(self, block: str) -> int:
        """Number of scalar parameters ``d_g`` of ``block`` (eigenvalues beyond those listed are 0)."""
        return self._blocks[block].dim

    def dims(self) -> dict[str, int]:
        """``d_g`` of every block."""
        return {g: b.dim for g, b in self._blocks.items()}

    def deltas(self, delta: Precision) -> dict[str, float]:
        """``δ_g`` for every block from a mapping or one number, checked ``> 0`` and finite."""
        if is_number(delta):
            out = dict.fromkeys(self.names, float(delta))
        elif isinstance(delta, Mapping):
            missing = [g for g in self.names if g not in delta]
            if missing:
                raise FlatbmaError(
                    f"prior precision: no value for block(s) {missing[:3]}; give one per block or one number"
                )
            out = {g: float(delta[g]) for g in self.names}
        else:
            raise FlatbmaError(
                f"prior precision must be a positive number or one per block, got {type(delta).__name__}"
            )
        bad = [(g, v) for g, v in out.items() if not (math.isfinite(v) and v > 0)]
        if bad:
            raise FlatbmaError(f"prior precision must be positive and finite, got {bad[0][1]!r} for {bad[0][0]!r}")
        return out

    def logdet(self, delta: Precision, temperature: float) -> float:
        """``log det(H/T + diag δ) = Σ_g log det(H_g/T + δ_g I)``."""
        t, deltas = check_temperature(temperature), self.deltas(delta)
        return sum(b.logdet(deltas[g], t) for g, b in self._blocks.items())

    def scale_noise(self, z: Mapping[str, Tensor], delta: Precision, temperature: float) -> Params:
        """``Δ = S z`` with ``S Sᵀ = P⁻¹`` (the table of the module docstring), float64, by parameter name.

        A linear map of ``z``: applied to standard-normal ``z`` it gives ``Δ ~ N(0, P⁻¹)``.
        """
        t, deltas = check_temperature(temperature), self.deltas(delta)
        out: Params = {}
        for g, b in self._blocks.items():
            out.update(b.scale(z, deltas[g], t))
        return dict(sorted(out.items()))

    def sample(
        self, n: int, delta: Precision, temperature: float, generator: torch.Generator | None = None
    ) -> list[Params]:
        """``n`` draws ``Δ ~ N(0, P⁻¹)``, by parameter name in the parameters' dtypes.

        Each takes ``z ~ N(0, I)`` from ``generator`` by :func:`flatbma.gaussian.standard_normal_like`, sorted names.
        """
        like = {k: torch.empty(s, dtype=self.dtypes[k], device=self._device) for k, s in sorted(self._shapes.items())}
        draws = []
        for _ in range(n):
            z = standard_normal_like(like, generator)
            draws.append(self._cast(self.scale_noise(z, delta, temperature)))
        return draws

    def marginal_variance(self, delta: Precision, temperature: float) -> Params:
        """``diag P⁻¹`` by parameter name, in the parameters' shapes and dtypes."""
        t, deltas = check_temperature(temperature), self.deltas(delta)
        out: Params = {}
        for g, b in self._blocks.items():
            out.update(b.marginal_variance(deltas[g], t))
        return self._cast(dict(sorted(out.items())))

    def functional_variance(self, jac: Mapping[str, Tensor], delta: Precision, temperature: float) -> Tensor:
        """``diag(J P⁻¹ Jᵀ)`` ``[B, C]`` from per-example Jacobians ``{name: [B, C, *shape]}`` (J's dtype).

        ``jac`` must hold every parameter of the blocks.
        """
        missing = sorted(set(self._shapes) - set(jac))
        if missing:
            raise FlatbmaError(f"functional_variance: the Jacobian has no entry for {missing[:3]}")
        t, deltas = check_temperature(temperature), self.deltas(delta)
        total = sum(b.functional_variance(jac, deltas[g], t) for g, b in self._blocks.items())
        return total.to(next(iter(jac.values())).dtype)

    def _cast(self, tensors: Params) -> Params:
        return {k: v.to(self.dtypes[k]) for k, v in tensors.items()}


def _shapes_of(block: Block) -> tuple[torch.Size, ...]:
    if isinstance(block, DiagBlock):
        return (block.h.shape,)
    if isinstance(block, KronBlock):
        return (block.shape,)
    return block.shapes


def check_temperature(temperature: float) -> float:
    """``temperature`` as a float, or a :class:`FlatbmaError` unless it is a positive finite number."""
    if not (is_number(temperature) and math.isfinite(temperature) and temperature > 0):
        raise FlatbmaError(f"temperature must be a positive number, got {temperature!r}")
    return float(temperature)
