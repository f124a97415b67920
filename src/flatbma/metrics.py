"""Classification and uncertainty metrics of a BMA predictive, offline and streaming (docs/methods.md §7).

Every function takes the BMA predictive **log-probabilities** ``log_probs`` ``[B, C]`` and integer labels ``[B]``.
Notation: ``p_ic = exp(log_probs[i, c])``, ``ŷ_i = argmax_c p_ic`` (ties to the lowest class index),
``conf_i = max_c p_ic``, ``correct_i = 1[ŷ_i = y_i]``, ``n = B``.

**Soft targets.** Labels may instead be float class probabilities ``q`` ``[B, C]`` (rows summing to 1 within
1e-4). NLL is then ``−Σ_c q_ic log p_ic`` (``0 · log 0 = 0``), Brier ``Σ_c (p_ic − q_ic)²``; accuracy and the
calibration metrics score correctness against ``y_i = argmax_c q_ic``. One-hot rows give their labels' numbers.

All arithmetic is float64; :class:`StreamingMetrics` keeps O(bins) sums, summable across processes, and matches
the offline values up to float64 rounding (adaptive ECE: up to a stated binning error). Malformed input (wrong
shapes, labels out of range, unnormalized log-probabilities such as logits) raises
:class:`~flatbma.errors.FlatbmaError`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from flatbma.checks import check_int
from flatbma.errors import FlatbmaError

__all__ = [
    "StreamingMetrics",
    "accuracy",
    "adaptive_ece",
    "bin_index",
    "brier",
    "ece",
    "nll",
    "ood_auroc",
    "predictive_entropy",
    "reliability_diagram",
    "uncertainty_decomposition",
]

_F64 = torch.float64


# ---------------------------------------------------------------- input checks
def _normalization_atol(dtype: torch.dtype) -> float:
    # Loose enough for a float32/half log-mean-exp, tight enough to reject logits and probabilities.
    return max(1e-3, 8.0 * torch.finfo(dtype).eps)


def _require_tensor(value: object, name: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise FlatbmaError(
            f"{name} must be a torch.Tensor, got {type(value).__name__}; wrap it with torch.as_tensor(...)."
        )
    return value


def _check_log_probs(log_probs: object, num_classes: int | None = None, allow_empty: bool = False) -> Tensor:
    """Validate ``log_probs`` and return it as float64."""
    log_probs = _require_tensor(log_probs, "log_probs")
    if log_probs.ndim != 2:
        raise FlatbmaError(
            f"log_probs must have shape [batch, num_classes], got shape {tuple(log_probs.shape)}; "
            "for a single example use log_probs.unsqueeze(0)."
        )
    if not log_probs.is_floating_point():
        raise FlatbmaError(
            f"log_probs must be a floating-point tensor of log-probabilities, got dtype {log_probs.dtype}."
        )
    batch, classes = log_probs.shape
    if classes < 1:
        raise FlatbmaError("log_probs has 0 classes; expected shape [batch, num_classes] with num_classes ≥ 1.")
    if num_classes is not None and classes != num_classes:
        raise FlatbmaError(f"log_probs has {classes} classes but this metric was built with num_classes={num_classes}.")
    if batch == 0 and not allow_empty:
        raise FlatbmaError("log_probs is empty (batch size 0); pass at least one example.")
    lp = log_probs.detach().to(_F64)
    bad = torch.isnan(lp).any(dim=1) | torch.isposinf(lp).any(dim=1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise FlatbmaError(f"log_probs row {row} contains NaN or +inf; log-probabilities must be ≤ 0.")
    lse = torch.logsumexp(lp, dim=1)
    atol = _normalization_atol(log_probs.dtype)
    off = ~(lse.abs() <= atol)  # also catches rows that are all -inf (lse = -inf)
    if bool(off.any()):
        row = int(off.nonzero()[0, 0])
        raise FlatbmaError(
            f"log_probs row {row} is not normalized: logsumexp over classes is {float(lse[row]):.6g}, "
            f"expected 0 (±{atol:g}). Pass log-probabilities (torch.log_softmax(logits, -1), or "
            "torch.logsumexp(per_sample_log_probs, 0) - log(M) for a BMA), not logits or probabilities."
        )
    return lp


def _check_inputs(
    log_probs: object, labels: object, num_classes: int | None = None, allow_empty: bool = False
) -> tuple[Tensor, Tensor]:
    """The metrics' one validation prologue: float64 ``log_probs`` ``[B, C]`` and the labels checked against it."""
    lp = _check_log_probs(log_probs, num_classes=num_classes, allow_empty=allow_empty)
    return lp, _check_labels(labels, lp.shape[0], lp.shape[1], lp.device)


def _check_labels(labels: object, batch: int, num_classes: int, device: torch.device) -> Tensor:
    """Validate ``labels`` against a ``[batch, num_classes]`` prediction: int64 indices, or float64 soft targets."""
    labels = _require_tensor(labels, "labels")
    if labels.is_floating_point() and labels.ndim == 2:
        return _check_soft_targets(labels, batch, num_classes, device)
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise FlatbmaError(
            f"labels must be an integer tensor of class indices [batch] or float class probabilities "
            f"[batch, classes], got dtype {labels.dtype} of shape {tuple(labels.shape)}."
        )
    if labels.ndim != 1 or labels.shape[0] != batch:
        raise FlatbmaError(
            f"labels must have shape [{batch}] to match log_probs of shape [{batch}, {num_classes}], "
            f"got shape {tuple(labels.shape)}."
        )
    y = labels.detach().to(device=device, dtype=torch.int64)
    if batch:
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= num_classes:
            raise FlatbmaError(
                f"labels must lie in [0, {num_classes - 1}] for {num_classes} classes, got values in [{lo}, {hi}]."
            )
    return y


def _check_positive_int(value: object, name: str) -> int:
    return check_int(value, f"{name} must be an integer ≥ 1, got {value!r}.", minimum=1)


def _check_scores(scores: object, name: str) -> Tensor:
    scores = _require_tensor(scores, name)
    if scores.ndim != 1:
        raise FlatbmaError(f"{name} must be 1-D (one score per example), got shape {tuple(scores.shape)}.")
    if scores.numel() == 0:
        raise FlatbmaError(f"{name} is empty; AUROC needs at least one example on each side.")
    s = scores.detach().to(_F64)
    if bool(torch.isnan(s).any()):
        raise FlatbmaError(f"{name} contains NaN.")
    return s


# ---------------------------------------------------------------- per-example quantities and binning (shared)
def _check_soft_targets(targets: Tensor, batch: int, num_classes: int, device: torch.device) -> Tensor:
    """Validate soft targets ``[batch, num_classes]`` (probability rows) and return them as float64."""
    if tuple(targets.shape) != (batch, num_classes):
        raise FlatbmaError(
            f"soft targets must have shape [{batch}, {num_classes}] to match log_probs of shape "
            f"[{batch}, {num_classes}], got shape {tuple(targets.shape)}."
        )
    q = targets.detach().to(device=device, dtype=_F64)
    if batch and not bool((torch.isfinite(q) & (q >= 0)).all() and ((q.sum(dim=1) - 1.0).abs() <= _SOFT_ATOL).all()):
        raise FlatbmaError(
            "soft targets must be class probabilities: finite, non-negative rows that sum to 1 (e.g. one-hot "
            "or label-smoothed rows)."
        )
    return q


_SOFT_ATOL = 1e-4
"""How far from 1 a soft target's row sum may be (float32 rounding of smoothed rows): the training check's."""


def _per_example(lp: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Float64 ``(conf, correct, nll, brier)`` per example from checked labels ``[B]`` or soft targets ``[B, C]``."""
    max_lp, pred = lp.max(dim=1)  # first maximal index on ties
    conf = max_lp.exp()
    p = lp.exp()
    if y.is_floating_point():  # soft targets
        correct = (pred == y.argmax(dim=1)).to(_F64)  # argmax: first maximal index on ties
        nll_i = -torch.where(y > 0, y * lp, torch.zeros_like(lp)).sum(dim=1)  # 0 · log 0 counts 0
        brier_i = (p - y).square().sum(dim=1)
        return conf, correct, nll_i, brier_i
    correct = (pred == y).to(_F64)
    nll_i = -lp.gather(1, y[:, None]).squeeze(1)  # +inf where the true class has probability 0
    onehot = torch.nn.functional.one_hot(y, lp.shape[1]).to(_F64)
    brier_i = (p - onehot).square().sum(dim=1)
    return conf, correct, nll_i, brier_i


def bin_index(values: Tensor, n_bins: int) -> Tensor:
    """Index of the equal-width bin of ``[0, 1]`` holding each value: int64, shaped like ``values``.

    ``idx = clamp(ceil(value * n_bins) - 1, 0, n_bins - 1)`` in float64: bin ``b`` covers
    ``(b/n_bins, (b+1)/n_bins]``, 0 goes in the first bin and values outside ``[0, 1]`` in the first or last
    (``n_bins=4``: 0 → 0, 0.25 → 0, 0.5 → 1, 1.0 → 3). An edge float64 cannot represent exactly (0.2 with
    15 bins) may land on either side.
    """
    n_bins = _check_positive_int(n_bins, "n_bins")
    idx = torch.ceil(values.to(_F64) * n_bins) - 1
    return idx.clamp(0, n_bins - 1).to(torch.int64)


def _binned_sums(idx: Tensor, n_bins: int, conf: Tensor, correct: Tensor) -> Tensor:
    """``[3, n_bins]`` float64 table of per-bin (count, Σ conf, Σ correct)."""
    values = torch.stack([torch.ones_like(conf), conf, correct], dim=1)
    out = torch.zeros(n_bins, 3, dtype=_F64, device=conf.device).index_add_(0, idx, values)
    return out.T.contiguous()


def _ece_from_bins(sums: Tensor, n: float) -> float:
    """``(1/n) Σ_b |Σcorrect_b − Σconf_b|`` = ``Σ_b (n_b/n) |acc_b − conf_b|``."""
    return float((sums[2] - sums[1]).abs().sum() / n)


def _reliability_from_bins(sums: Tensor, n_bins: int) -> dict[str, Tensor]:
    count, s_conf, s_correct = sums.cpu()
    with torch.no_grad():
        nan = torch.full_like(count, float("nan"))
        nonempty = count > 0
        mean_conf = torch.where(nonempty, s_conf / count.clamp_min(1), nan)
        acc = torch.where(nonempty, s_correct / count.clamp_min(1), nan)
    return {
        "bin_edges": torch.linspace(0.0, 1.0, n_bins + 1, dtype=_F64),
        "count": count.clone(),
        "confidence": mean_conf,
        "accuracy": acc,
    }


def _equal_mass_boundaries(n: int, n_groups: int) -> list[int]:
    """Ranks ``P_0 = 0 ≤ … ≤ P_G = n`` splitting ``n`` items into ``G`` chunks sized as ``numpy.array_split``."""
    q, r = divmod(n, n_groups)
    return [g * q + min(g, r) for g in range(n_groups + 1)]


def _entropy(lp: Tensor) -> Tensor:
    """``H_i = −Σ_c p_ic log p_ic`` with ``0 · log 0 = 0``, float64."""
    terms = torch.where(torch.isneginf(lp), torch.zeros((), dtype=_F64, device=lp.device), lp.exp() * lp)
    return -terms.sum(dim=1)


def _auroc_counts(scores_in: Tensor, scores_out: Tensor) -> Tensor:
    """``Σ_{o} (#{in < o} + #{in ≤ o})`` = ``2 · n_in · n_out · AUROC`` (ties count ½), exact in int64."""
    sorted_in = torch.sort(scores_in).values
    less = torch.searchsorted(sorted_in, scores_out, right=False)
    leq = torch.searchsorted(sorted_in, scores_out, right=True)
    return (less + leq).sum()


# ---------------------------------------------------------------- offline metrics
def accuracy(log_probs: Tensor, labels: Tensor) -> float:
    """Top-1 accuracy ``(1/n) Σ_i 1[argmax_c p_ic = y_i]``, in ``[0, 1]``; ties go to the lowest class index.

    Raises:
        FlatbmaError: If the inputs are malformed (see the module docstring).
    """
    lp, y = _check_inputs(log_probs, labels)
    _, correct, _, _ = _per_example(lp, y)
    return float(correct.mean())


def nll(log_probs: Tensor, labels: Tensor) -> float:
    """Mean negative log-likelihood ``(1/n) Σ_i −log p(y_i | x_i)`` in nats, in ``[0, +inf]`` (nothing clamped).

    Raises:
        FlatbmaError: If the inputs are malformed (see the module docstring).
    """
    lp, y = _check_inputs(log_probs, labels)
    _, _, nll_i, _ = _per_example(lp, y)
    return float(nll_i.mean())


def brier(log_probs: Tensor, labels: Tensor) -> float:
    """Brier score ``(1/n) Σ_i Σ_c (p_ic − 1[y_i = c])²``, in ``[0, 2]`` (multi-class definition, Brier 1950).

    With two classes, **twice** scikit-learn's ``brier_score_loss(y, p_1)``, which scores only the positive class.

    Raises:
        FlatbmaError: If the inputs are malformed (see the module docstring).
    """
    lp, y = _check_inputs(log_probs, labels)
    _, _, _, brier_i = _per_example(lp, y)
    return float(brier_i.mean())


def ece(log_probs: Tensor, labels: Tensor, n_bins: int = 15) -> float:
    """Expected calibration error with ``n_bins`` equal-width confidence bins, in ``[0, 1]``.

    ``ECE = Σ_b (n_b / n) |acc_b − conf_b| = (1/n) Σ_b |Σ_{i∈b} correct_i − Σ_{i∈b} conf_i|``, where bin ``b``
    holds the examples whose confidence has :func:`bin_index` ``b``, ``n_b`` is its size and ``acc_b`` /
    ``conf_b`` its mean correctness and confidence; empty bins contribute 0.

    Raises:
        FlatbmaError: If the inputs are malformed or ``n_bins < 1``.
    """
    n_bins = _check_positive_int(n_bins, "n_bins")
    lp, y = _check_inputs(log_probs, labels)
    conf, correct, _, _ = _per_example(lp, y)
    sums = _binned_sums(bin_index(conf, n_bins), n_bins, conf, correct)
    return _ece_from_bins(sums, lp.shape[0])


def adaptive_ece(log_probs: Tensor, labels: Tensor, n_bins: int = 15) -> float:
    """Adaptive (equal-mass) ECE, in ``[0, 1]``.

    The examples are stably sorted by confidence and split into ``n_bins`` consecutive chunks sized as
    ``numpy.array_split`` (empty chunks, when ``n < n_bins``, contribute 0); then, as for :func:`ece`,
    ``aECE = (1/n) Σ_g |Σ_{i∈g} correct_i − Σ_{i∈g} conf_i|``.

    Raises:
        FlatbmaError: If the inputs are malformed or ``n_bins < 1``.
    """
    n_bins = _check_positive_int(n_bins, "n_bins")
    lp, y = _check_inputs(log_probs, labels)
    conf, correct, _, _ = _per_example(lp, y)
    order = torch.sort(conf, stable=True).indices
    gap = correct[order] - conf[order]
    bounds = _equal_mass_boundaries(lp.shape[0], n_bins)
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    total = sum((chunk.sum().abs() for chunk in torch.split(gap, sizes)), start=gap.new_zeros(()))
    return float(total / lp.shape[0])


def predictive_entropy(log_probs: Tensor) -> Tensor:
    """Entropy of each predictive, ``H_i = −Σ_c p_ic log p_ic`` (``0 · log 0 = 0``): ``[B]`` float64 nats.

    Raises:
        FlatbmaError: If ``log_probs`` is malformed.
    """
    return _entropy(_check_log_probs(log_probs))


def uncertainty_decomposition(sample_log_probs: Tensor) -> dict[str, Tensor]:
    """Total, aleatoric and epistemic uncertainty of each example's BMA, from its per-sample predictives.

    With ``p_m = exp(sample_log_probs[m])`` (``[M, B, C]``, rows normalized) and the BMA ``p̄ = (1/M) Σ_m p_m``::

        total      H[p̄]                       (the BMA's predictive entropy)
        aleatoric  (1/M) Σ_m H[p_m]           (expected entropy)
        epistemic  H[p̄] − (1/M) Σ_m H[p_m]    (mutual information I(y; w | x))

    (Houlsby et al. 2011, BALD; Depeweg et al., ICML 2018). ``epistemic ≥ 0`` up to rounding (Jensen).

    Returns:
        ``{"total", "aleatoric", "epistemic"}``: ``[B]`` float64 nats; ``total = aleatoric + epistemic`` exactly.

    Raises:
        FlatbmaError: If ``sample_log_probs`` is not ``[M, B, C]`` or a row is malformed.
    """
    lps = _require_tensor(sample_log_probs, "sample_log_probs")
    if lps.ndim != 3 or lps.shape[0] < 1:
        raise FlatbmaError(
            f"sample_log_probs must have shape [num_samples, batch, num_classes], got shape {tuple(lps.shape)}"
        )
    m, b, c = lps.shape
    flat = _check_log_probs(lps.reshape(m * b, c))  # float64, every row normalized
    aleatoric = _entropy(flat).reshape(m, b).mean(0)
    bma = torch.logsumexp(flat.reshape(m, b, c), dim=0) - math.log(m)
    total = _entropy(bma)
    return {"total": total, "aleatoric": aleatoric, "epistemic": total - aleatoric}


def ood_auroc(entropy_in: Tensor, entropy_out: Tensor) -> float:
    """AUROC of predictive entropy as a detector of out-of-distribution (OOD) inputs.

    ``AUROC = P(H_out > H_in) + ½ P(H_out = H_in)`` over the scores ``entropy_in`` ``[n_in]`` and ``entropy_out``
    ``[n_out]`` (e.g. :func:`predictive_entropy`; the Mann–Whitney statistic, OOD the positive class), computed
    exactly with integer counts in O((n_in + n_out) log n_in). In ``[0, 1]``; 0.5 is chance.

    Raises:
        FlatbmaError: If either input is not a non-empty 1-D tensor, or contains NaN.
    """
    s_in = _check_scores(entropy_in, "entropy_in")
    s_out = _check_scores(entropy_out, "entropy_out").to(s_in.device)
    twice = _auroc_counts(s_in, s_out)
    return float(twice.to(_F64) / (2.0 * s_in.numel() * s_out.numel()))


def reliability_diagram(log_probs: Tensor, labels: Tensor, n_bins: int = 15) -> dict[str, Tensor]:
    """Per-bin statistics of the equal-width confidence binning used by :func:`ece`.

    Returns:
        Float64 CPU tensors: ``bin_edges`` ``[n_bins + 1]``, and ``[n_bins]`` ``count`` (``n_b``),
        ``confidence`` (``conf_b``) and ``accuracy`` (``acc_b``); the last two are NaN for empty bins.

    Raises:
        FlatbmaError: If the inputs are malformed or ``n_bins < 1``.
    """
    n_bins = _check_positive_int(n_bins, "n_bins")
    lp, y = _check_inputs(log_probs, labels)
    conf, correct, _, _ = _per_example(lp, y)
    return _reliability_from_bins(_binned_sums(bin_index(conf, n_bins), n_bins, conf, correct), n_bins)


# ---------------------------------------------------------------- streaming metrics
def _check_state(states: Sequence[Tensor], shapes: list[tuple[int, ...]], owner: str) -> None:
    if len(states) != len(shapes):
        raise FlatbmaError(f"{owner}.load_state_tensors expects {len(shapes)} tensors, got {len(states)}.")
    for k, (t, shape) in enumerate(zip(states, shapes, strict=True)):
        if not isinstance(t, Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise FlatbmaError(
                f"{owner}.load_state_tensors: tensor {k} must have shape {shape}, got {got}; pass the list "
                "returned by state_tensors() of a metric built with the same arguments."
            )


class StreamingMetrics:
    """Accuracy, NLL, Brier, ECE and adaptive ECE accumulated over batches in O(bins) memory.

    State (float64): totals ``n``, ``Σ correct``, ``Σ −log p(y|x)``, ``Σ Brier``, and the count, ``Σ conf`` and
    ``Σ correct`` per bin of the ``n_bins`` :func:`ece` bins and of ``n_fine_bins`` fine equal-width bins.
    Accuracy, NLL, Brier and ECE equal the offline functions on the concatenated data up to float64 rounding.

    Adaptive ECE places the equal-mass chunk boundaries of :func:`adaptive_ece` by linear interpolation of
    the cumulative fine-bin sums. It equals the offline value whenever no fine bin holds examples of two
    chunks, and otherwise differs by at most ``(2/n) Σ_j n_j`` over the fine bins ``j`` straddling a boundary.

    Distributed use: ``all_reduce`` (sum) every tensor of :meth:`state_tensors` over the processes, then
    ``load_state_tensors`` them and ``compute`` anywhere.

    ``num_classes``: the ``C`` columns of every batch; ``n_bins``: the bins of ECE and the reliability diagram, and
    adaptive ECE's chunks; ``n_fine_bins``: the fine bins adaptive ECE interpolates; ``device``: where the state
    lives (where the log-probs are avoids transfers).

    Raises:
        FlatbmaError: If an argument is not an integer ≥ 1.
    """

    def __init__(
        self,
        num_classes: int,
        n_bins: int = 15,
        n_fine_bins: int = 1000,
        device: torch.device | str | None = None,
    ) -> None:
        self.num_classes = _check_positive_int(num_classes, "num_classes")
        self.n_bins = _check_positive_int(n_bins, "n_bins")
        self.n_fine_bins = _check_positive_int(n_fine_bins, "n_fine_bins")
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.reset()

    def reset(self) -> None:
        """Forget all accumulated examples."""
        self._totals = torch.zeros(4, dtype=_F64, device=self.device)  # n, Σcorrect, Σnll, Σbrier
        self._bins = torch.zeros(3, self.n_bins, dtype=_F64, device=self.device)
        self._fine = torch.zeros(3, self.n_fine_bins, dtype=_F64, device=self.device)

    @torch.no_grad()
    def update(self, log_probs: Tensor, labels: Tensor) -> None:
        """Add a batch (an empty batch is a no-op): ``log_probs`` ``[B, C]``, ``[B]`` labels or ``[B, C]`` soft targets.

        Raises:
            FlatbmaError: If the inputs are malformed or ``C != num_classes``.
        """
        lp, y = _check_inputs(log_probs, labels, num_classes=self.num_classes, allow_empty=True)
        if lp.shape[0] == 0:
            return
        conf, correct, nll_i, brier_i = _per_example(lp, y)
        totals = torch.stack([conf.new_tensor(float(lp.shape[0])), correct.sum(), nll_i.sum(), brier_i.sum()])
        self._totals += totals.to(self.device)
        self._bins += _binned_sums(bin_index(conf, self.n_bins), self.n_bins, conf, correct).to(self.device)
        fine = _binned_sums(bin_index(conf, self.n_fine_bins), self.n_fine_bins, conf, correct)
        self._fine += fine.to(self.device)

    def _n(self) -> float:
        n = float(self._totals[0])
        if n == 0:
            raise FlatbmaError("StreamingMetrics has seen no examples; call update() before compute().")
        return n

    def compute(self) -> dict[str, float]:
        """Metrics of all examples seen so far: ``{"accuracy", "nll", "ece", "aece", "brier", "n"}`` as floats.

        Raises:
            FlatbmaError: If no example has been seen.
        """
        n = self._n()
        totals = self._totals.cpu()
        return {
            "accuracy": float(totals[1] / n),
            "nll": float(totals[2] / n),
            "ece": _ece_from_bins(self._bins.cpu(), n),
            "aece": self._adaptive_ece(n),
            "brier": float(totals[3] / n),
            "n": n,
        }

    def _adaptive_ece(self, n: float) -> float:
        count, s_conf, s_correct = self._fine.cpu()
        keep = count > 0
        zero = torch.zeros(1, dtype=_F64)
        # Cumulative count c_k and cumulative Σ(correct − conf) D_k at the right edge of each
        # non-empty fine bin (c strictly increasing, c_0 = D_0 = 0).
        c = torch.cat([zero, count[keep].cumsum(0)])
        d = torch.cat([zero, (s_correct[keep] - s_conf[keep]).cumsum(0)])
        ranks = torch.tensor(_equal_mass_boundaries(round(n), self.n_bins), dtype=_F64)
        k = torch.searchsorted(c, ranks).clamp(1, c.numel() - 1)
        frac = ((ranks - c[k - 1]) / (c[k] - c[k - 1])).clamp(0.0, 1.0)
        d_at = torch.where(frac == 1.0, d[k], d[k - 1] + frac * (d[k] - d[k - 1]))
        return float(d_at.diff().abs().sum() / n)

    def reliability(self) -> dict[str, Tensor]:
        """Reliability diagram of all examples seen so far, as :func:`reliability_diagram` returns it."""
        return _reliability_from_bins(self._bins, self.n_bins)

    def state_tensors(self) -> list[Tensor]:
        """Copies of the state to sum across processes: ``[totals [4], bins [3, n_bins], fine [3, n_fine_bins]]``."""
        return [self._totals.clone(), self._bins.clone(), self._fine.clone()]

    def load_state_tensors(self, states: Sequence[Tensor]) -> None:
        """Replace the state by ``states``, shaped as :meth:`state_tensors` returns them (e.g. summed over processes).

        Raises:
            FlatbmaError: If the number or shapes of the tensors do not match.
        """
        _check_state(states, [(4,), (3, self.n_bins), (3, self.n_fine_bins)], owner=type(self).__name__)
        self._totals, self._bins, self._fine = (t.detach().to(device=self.device, dtype=_F64).clone() for t in states)

    def merge(self, other: StreamingMetrics) -> StreamingMetrics:
        """Add the examples accumulated by ``other`` (built with the same arguments) into ``self``; return ``self``.

        Raises:
            FlatbmaError: If ``other`` was built with different ``num_classes``/``n_bins``/``n_fine_bins``.
        """
        if not isinstance(other, StreamingMetrics):
            raise FlatbmaError(f"can only merge a StreamingMetrics, got {type(other).__name__}.")
        mine = (self.num_classes, self.n_bins, self.n_fine_bins)
        theirs = (other.num_classes, other.n_bins, other.n_fine_bins)
        if mine != theirs:
            raise FlatbmaError(
                f"cannot merge StreamingMetrics with (num_classes, n_bins, n_fine_bins)={theirs} into one "
                f"with {mine}; build both with the same arguments."
            )
        self._totals += other._totals.to(self.device)
        self._bins += other._bins.to(self.device)
        self._fine += other._fine.to(self.device)
        return self
