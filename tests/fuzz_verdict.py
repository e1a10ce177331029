"""The differential fuzzer's verdict (tests/test_fuzz_parity.py): what must equal stock ZeRO-3 bit for bit, and
what may differ, by how much, and why.

Same arithmetic, exact comparison. A case sums its gradients in stock's order when it has no sequence parallelism
and d_g = N (then d_o = N too): each backward's gradient bucket is reduce-scattered over the whole world, in
stock's layout of the bucket and through the same collective, then added into the gradient partition as stock adds
it, with no cross-node sum and no replica all-reduce after; the optimizer steps the same partitions. Such a case
trains on its own, as a user would, and its losses (every rank's, every step), its consolidated parameters and its
GatheredParameters reads must be bit-identical to stock's.

Another order, teacher forcing. Every other case (d_g < N: a sum inside the d_g group every backward, then across
nodes once per step, then over the optimizer replicas; and every Ulysses SP case, counted here whatever its
layout) adds the same terms in another order. Only the reduced gradients see that order, so only they are compared
against a bound, and everything else stays exact: at each optimizer step, after the window's last backward and
before the step, AsyncHZP's reduced gradient is compared with stock's for that step and then overwritten with it
(in its gradient partitions, which are the own atoms of its gradient shard; under optimizer offload also in the
host gradients and the per-parameter norms of the parameters it copied at that boundary, taken again from the
forced partitions as its boundary copy takes them). Both arms then step the same master weights with the same
gradients (and where d_o < N, the step itself is forced too, below), so parameters, the next step's losses and
each rank's next local gradients stay bit-identical: losses, parameters and reads are compared exactly in these
cases too, and the terms that enter the next sums are the same in both arms.

The bound on a sum. One element of a parameter's reduced gradient for a step is a sum of n terms x_1 .. x_n:

* each rank's local gradient from each backward that reduced the parameter in the window, divided by the
  averaging divisor (the world, or world / sp on Stage 3's all-reduce path under SP): every world the fuzzer draws
  is a power of two, so the division is exact, and both arms divide the same value;
* where stock's gradient partition carries a value into the window, that value: the window's first backward
  overwrites the partition (stock copies there), so a parameter that gets no gradient in it keeps the gradient of
  the previous step, and the later backwards add to it.

Under Ulysses SP each rank's local gradient is its partial over its slice of the sequence: one term of the same
world-wide sum, no further terms. Any order of summation is a binary tree of n - 1 additions (an addition of an
exact zero, the padding of a partition or an optimizer replica's empty row, is exact and does not count); each
rounds by a factor (1 + d), |d| <= u, the unit roundoff of the accumulation dtype (fp32, u = 2^-24: these models
train, communicate and accumulate in fp32), and a term passes through at most n - 1 of them. So (Higham, Accuracy
and Stability of Numerical Algorithms, 2nd ed., lemma 3.1 and section 4.2)

    fl(sum x_i) = sum x_i (1 + t_i),  |t_i| <= gamma_{n-1},  gamma_k = k u / (1 - k u),

in every order: each order is within gamma_{n-1} sum |x_i| of the exact sum, and two orders within

    |fl_1(sum x_i) - fl_2(sum x_i)| <= 2 gamma_{n-1} sum |x_i|.

n is N c + k per parameter and step: N the world (data-parallel and SP ranks alike), c the backwards of the window
that reduced the parameter (the gradient accumulation steps at most) and k = 1 where the kept value enters (the
parameter missed the window's first backward, or got no gradient at all: then n = 1 and the bound is 0, an exact
comparison). At most N GA + 1: 17 for 4 ranks and GA 4, 33 for 8 ranks.

sum |x_i| is measured, not estimated: in the stock arm a wrapper around Stage 3's two bucket reductions adds each
rank's |local gradient| / divisor, as it enters the reduction, and the kept partition's |value| where it enters,
into a float64 accumulator per parameter; one all-reduce (SUM) over the world per step gives every element's sum.
(Bounds are computed in float64 from magnitudes that are themselves float64 sums of at most 33 terms: their own
rounding, a relative 4e-15 at most, is covered by computing gamma with u (1 + 2^-20).)

A defect in the gradient path moves an element by far more: changing one element by 1e-3 relative exceeds its
bound hundreds of times (the bound is at most 2 gamma_32 = 3.8e-6 of sum |x_i|, which is within a small factor of
the element itself unless its terms cancel).

The step, where d_o < N. The optimizer then steps other partitions than stock's, and two things in it change with
the partition: the clipping norm (a sum of squares over the optimizer group, added in another order), and
DeepSpeed's CPU Adam, which updates a partition in SIMD blocks with fused multiply-adds and its last
(size mod SIMD width) elements in a scalar loop of separate multiplies and adds, so an element can be computed by
the one in stock and the other here. The step is then teacher-forced too: the norm Stage 3 clips with is compared
with stock's against its bound and replaced by stock's norms, and after Adam has updated a partition, its master
weights and both moments are compared with stock's against the bound of one Adam update and replaced by stock's;
Stage 3 then copies the forced master weights into the parameter shard and AsyncHZP refreshes from it, as always.

* The norm: N = sqrt(S), S a sum of positive terms (the squares of the gradient elements) through per-parameter
  norms in fp64 (squared again, summed over parameters and over the group in fp64; under offload the group's sum
  in fp32). Each term passes through at most K64 fp64 roundings (K64 = elements + parameters + ranks + 4) and K32
  fp32 roundings (K32 = ranks + 4), so S is within r_S = (1 + gamma^64_K64)(1 + gamma^32_K32) - 1 of its value
  relative (no cancellation: all terms are positive), N within r_N = sqrt(1 + r_S)(1 + u32) - 1, and two
  evaluations within 2 r_N N / (1 - r_N): about 6e-7 relative on 4 ranks.
* Adam (DeepSpeed's cpu_adam kernel, AdamW mode; the same inputs p, g, m, v in both arms, forced): with the
  kernel's constants c1 = 1 - b1, c2 = 1 - b2, the step size s = -lr / (1 - b1^t), b2' = 1 / sqrt(1 - b2^t) and
  w = -lr wd, it computes m' = g c1 + m b1, v' = (g g) c2 + v b2, d = sqrt(v') b2' + eps, q = m' / d,
  p1 = p + w p and p' = q s + p1, each operation rounded once (a fused multiply-add rounds once, a multiply then
  an add twice: both within the standard model, plus an absolute 2^-150 for a product or quotient that lands among
  the subnormals). Propagating the rounding of each operation (`adam_update_bound`)
  gives for each evaluation |m' - M| <= E_m = gamma_2 (|g| c1 + |m| b1), |v' - V| <= E_v = gamma_3 g^2 c2 +
  gamma_2 |v| b2, and bounds E_r, E_d, E_q, E_p for sqrt(v'), d, q and p', in terms of the exact values M, V,
  R = sqrt(V), D, Q = M / D, P1 (the kernel's constants are taken as computed in float64, a relative 1e-7 from
  its fp32 ones: a margin of 1e-4 on every bound covers that); two evaluations differ by at most twice each.

With d_o = N neither changes (the same partitions, the same code, the same order), and the step is compared as
it is, exactly.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, List

import deepspeed
import torch
from deepspeed.runtime.utils import combine_grad_norm_groups

from ds_asynchzp.platform.deepspeed_internals import (DeepSpeedZeroOptimizer_Stage3,
                                                      STAGE3_AVG_SCATTER_CONTIGUOUS_GRADS,
                                                      STAGE3_AVG_SCATTER_GRADS, STAGE3_GRAD_PARTITION_BY_PARAM_ID,
                                                      offload_grad_norm, offload_host_grad)

FP32_U = 2.0 ** -24
FP64_U = 2.0 ** -53
# The largest absolute rounding error of an fp32 result among the subnormals: half their spacing.
FP32_TINY = 2.0 ** -150
# Covers the float64 evaluation of the bounds themselves.
U_MARGIN = 1 + 2.0 ** -20
# Covers the kernel's fp32 constants taken as float64 (relative 1e-7) in the Adam bound.
ADAM_MARGIN = 1 + 1e-4


def summation_order_differs(spec: dict) -> bool:
    """Whether AsyncHZP adds the case's gradients in another order than stock: any SP, or d_g < N."""
    return spec.get("sp", 1) > 1 or spec["layout"]["grad_shard_size"] < spec["world"]


def step_partitions_differ(spec: dict) -> bool:
    """Whether the optimizer steps other partitions than stock's (d_o < N): its norm and Adam's placement."""
    return spec["layout"]["optimizer_shard_size"] < spec["world"]


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: half the distance from 1 to the next number (2^-24 for fp32)."""
    return torch.finfo(dtype).eps / 2


def gamma(k: int, u: float = FP32_U) -> float:
    """Higham's gamma_k = k u / (1 - k u), the relative bound of k roundings, with u inflated by U_MARGIN."""
    u = u * U_MARGIN
    assert k * u < 1
    return k * u / (1 - k * u)


def summation_bound(abs_sum: torch.Tensor, n: int, u: float = FP32_U) -> torch.Tensor:
    """How far apart two orders of summing n terms whose magnitudes add up to `abs_sum` can come out."""
    return 2 * gamma(max(n - 1, 0), u) * abs_sum


def norm_bound(norm: float, elements: int, params: int, ranks: int) -> float:
    """How far apart two evaluations of Stage 3's clipping norm (in any order) can come out (module docstring)."""
    r_s = (1 + gamma(elements + params + ranks + 4, FP64_U)) * (1 + gamma(ranks + 4)) - 1
    r_n = math.sqrt(1 + r_s) * (1 + FP32_U * U_MARGIN) - 1
    return 2 * r_n * abs(norm) / (1 - r_n)


def adam_update_bound(p, g, m, v, lr: float, betas, eps: float, weight_decay: float, step: int) -> tuple:
    """Elementwise bounds on how far apart two evaluations of one update of DeepSpeed's CPU Adam kernel (AdamW
    mode, bias correction) from the same fp32 inputs can come out: (params, exp_avg, exp_avg_sq). Float64 in,
    float64 out (module docstring for the derivation)."""
    b1, b2 = betas
    c1, c2 = 1 - b1, 1 - b2
    s = lr / (1 - b1 ** step)                      # |step size|
    bias2 = 1 / math.sqrt(1 - b2 ** step)
    w = lr * weight_decay                          # |w|
    u = FP32_U * U_MARGIN
    g2, g3 = gamma(2), gamma(3)
    m_exact, v_exact = g * c1 + m * b1, g * g * c2 + v * b2
    # A product or quotient that lands among the subnormals rounds by up to FP32_TINY absolutely, not relatively
    # (a sum that does is exact): one such term per multiplication or division on a path.
    e_m = g2 * (g.abs() * c1 + m.abs() * b1) + 2 * FP32_TINY
    e_v = g3 * g * g * c2 + g2 * v.abs() * b2 + 3 * FP32_TINY
    r = v_exact.clamp_min(0).sqrt()
    # |sqrt(a) - sqrt(b)| <= |a - b| / sqrt(b) and <= sqrt(|a - b|); then the rounding of the sqrt.
    y = torch.minimum(torch.where(r > 0, e_v / r, torch.full_like(r, math.inf)), e_v.sqrt())
    e_r = y * (1 + u) + u * r
    d = r * bias2 + eps
    e_d = bias2 * e_r + g2 * ((r + e_r) * bias2 + eps) + FP32_TINY
    d_lo = d - e_d
    assert bool((d_lo > 0).all()), "the Adam bound needs eps above the denominator's rounding"
    q = m_exact / d
    x = (e_m + q.abs() * e_d) / d_lo
    e_q = x * (1 + u) + u * q.abs() + FP32_TINY
    p1 = p * (1 - w)
    e_p1 = g2 * (p.abs() * w + p.abs()) + FP32_TINY if weight_decay > 0 else torch.zeros_like(p)
    e_p = s * e_q + e_p1 + g2 * ((q.abs() + e_q) * s + p1.abs() + e_p1) + FP32_TINY
    return 2 * ADAM_MARGIN * e_p, 2 * ADAM_MARGIN * e_m, 2 * ADAM_MARGIN * e_v


def _partition_slice(optimizer, param):
    """(start, real) of this rank's partition of `param` in the flattened parameter: where it starts, and how many
    of its elements are the parameter's (the rest is padding)."""
    start = optimizer._get_param_partition_rank(param) * param.partition_numel()
    return start, max(0, min(param.partition_numel(), param.ds_numel - start))


def _offload_norm_names(optimizer, params: Dict[str, torch.nn.Parameter]) -> set:
    """The parameters whose gradient this rank copied to the host at this boundary (Stage 3 records their norms,
    which clipping sums, and forgets them after the step)."""
    recorded = optimizer.norm_for_param_grads
    return {name for name, p in params.items() if optimizer.get_param_id(p) in recorded}


def _step_state(optimizer, param) -> list:
    """This rank's master weights, exp_avg and exp_avg_sq of `param` (views of Stage 3's flat partitions)."""
    group, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
    flat = optimizer.fp32_partitioned_groups_flat[group]
    state = optimizer.optimizer.state[flat]
    return [flat.narrow(0, offset, numel), state["exp_avg"].narrow(0, offset, numel),
            state["exp_avg_sq"].narrow(0, offset, numel)]


def _trainable(optimizer, model) -> Dict[str, torch.nn.Parameter]:
    partitions = getattr(optimizer, STAGE3_GRAD_PARTITION_BY_PARAM_ID)
    return {name: p for name, p in model.named_parameters() if p.ds_id in partitions}


class StockRecord:
    """In the stock arm, per optimizer step: every trainable parameter's reduced gradient (the full tensor, on
    every rank), the magnitudes of its terms summed and their count n, which parameters stock copied to the host
    (offload); with `step` also the norms Stage 3 clipped with and the master weights and moments after the step.
    `hooks()` wraps Stage 3's bucket reductions while the arm trains."""

    def __init__(self, step: bool = False):
        self.record_step = step
        self.steps: List[dict] = []
        self.optimizer = None
        self.params: Dict[str, torch.nn.Parameter] = {}

    def attach(self, engine, model) -> None:
        self.optimizer = engine.optimizer
        self.params = _trainable(self.optimizer, model)
        self._by_id = {p.ds_id: name for name, p in self.params.items()}
        self.world = deepspeed.comm.get_world_size()
        if self.record_step:
            original = self.optimizer._get_norm_groups

            def get_norm_groups():
                self._norm_groups = [n.detach().clone() for n in original()]
                return self._norm_groups

            self.optimizer._get_norm_groups = get_norm_groups
        self.begin_window()

    def begin_window(self) -> None:
        self.abs_sum = {name: torch.zeros(p.ds_numel, dtype=torch.float64) for name, p in self.params.items()}
        self.reductions = {name: 0 for name in self.params}
        self.kept = set()       # the parameters whose partition carries a value into this window

    def _terms(self, optimizer, params, divisor: float) -> None:
        if optimizer is not self.optimizer:
            return
        partitions = getattr(optimizer, STAGE3_GRAD_PARTITION_BY_PARAM_ID)
        for param in params:
            name = self._by_id[param.ds_id]
            if self.reductions[name] == 0 and optimizer.micro_step_id != 0:
                # Its first gradient of the window comes after the first backward: stock adds it to the value its
                # partition kept, one more term (on the rank that holds that partition).
                self.kept.add(name)
                start, real = _partition_slice(optimizer, param)
                self.abs_sum[name][start:start + real] += partitions[param.ds_id][:real].double().abs()
            self.reductions[name] += 1
            self.abs_sum[name] += param.grad.detach().reshape(-1).double().abs() / divisor

    @contextlib.contextmanager
    def hooks(self):
        """Stage 3's reduce-scatter path divides each gradient by the world before the sum; its all-reduce path
        (reduce_scatter false, a bucket within reduce_bucket_size) by world / sp."""
        owner = DeepSpeedZeroOptimizer_Stage3
        scatter = getattr(owner, STAGE3_AVG_SCATTER_GRADS)
        contiguous = getattr(owner, STAGE3_AVG_SCATTER_CONTIGUOUS_GRADS)
        recorder = self

        def avg_scatter_grads(self, params_to_reduce, communication_data_type):
            recorder._terms(self, params_to_reduce, recorder.world)
            return scatter(self, params_to_reduce, communication_data_type)

        def avg_scatter_contiguous_grads(self, buffer_to_reduce, communication_data_type):
            recorder._terms(self, self.ipg_buckets[communication_data_type].params,
                            recorder.world / self.sequence_parallel_size)
            return contiguous(self, buffer_to_reduce, communication_data_type)

        setattr(owner, STAGE3_AVG_SCATTER_GRADS, avg_scatter_grads)
        setattr(owner, STAGE3_AVG_SCATTER_CONTIGUOUS_GRADS, avg_scatter_contiguous_grads)
        try:
            yield self
        finally:
            setattr(owner, STAGE3_AVG_SCATTER_GRADS, scatter)
            setattr(owner, STAGE3_AVG_SCATTER_CONTIGUOUS_GRADS, contiguous)

    def _gather(self, local: List[torch.Tensor], widths: List[int]) -> List[torch.Tensor]:
        """Each rank's `local` pieces (partitions over the world) put together: the full tensors, padded."""
        flat = torch.cat([t.reshape(-1) for t in local])
        every = torch.empty(self.world * flat.numel(), dtype=flat.dtype)
        deepspeed.comm.all_gather_into_tensor(every, flat)
        every = every.view(self.world, -1)
        full, offset = [], 0
        for width in widths:
            full.append(every[:, offset:offset + width].reshape(-1).clone())
            offset += width
        return full

    @torch.no_grad()
    def boundary(self) -> None:
        """After the window's last backward, before the step (every rank): one all-gather of the gradient
        partitions, one all-reduce of the magnitudes."""
        optimizer = self.optimizer
        partitions = getattr(optimizer, STAGE3_GRAD_PARTITION_BY_PARAM_ID)
        names = list(self.params)
        copied = _offload_norm_names(optimizer, self.params) if optimizer.offload_optimizer else set()
        flags = torch.tensor([1.0 if name in copied else 0.0 for name in names], dtype=torch.float64)
        magnitudes = torch.cat([self.abs_sum[name] for name in names] + [flags])
        deepspeed.comm.all_reduce(magnitudes)
        local = [partitions[self.params[name].ds_id] for name in names]
        full = self._gather(local, [t.numel() for t in local])
        grads, at = {}, 0
        for name, tensor in zip(names, full):
            numel = self.params[name].ds_numel
            k = 1 if name in self.kept or self.reductions[name] == 0 else 0
            grads[name] = (tensor[:numel], magnitudes[at:at + numel].clone(), self.world * self.reductions[name] + k)
            at += numel
        copied_anywhere = {name for name, flag in zip(names, magnitudes[at:].tolist()) if flag > 0}
        self.steps.append({"grads": grads, "offload_copied": copied_anywhere, "dtype": local[0].dtype})
        self.begin_window()

    @torch.no_grad()
    def after_step(self) -> None:
        """After the step (every rank, `step` only): one all-gather of the master weights and moments."""
        if not self.record_step:
            return
        names = list(self.params)
        local = [t for name in names for t in _step_state(self.optimizer, self.params[name])]
        full = self._gather(local, [t.numel() for t in local])
        after = {}
        for i, name in enumerate(names):
            numel = self.params[name].ds_numel
            after[name] = tuple(t[:numel] for t in full[3 * i:3 * i + 3])
        self.steps[-1].update(after=after, norm_groups=self._norm_groups, elements=sum(
            p.ds_numel for p in self.params.values()))


class Verdict:
    """The largest |difference| / bound seen, per kind, and where."""

    def __init__(self):
        self.ratio: Dict[str, float] = {}
        self.worst: Dict[str, str] = {}
        self.max_abs_diff: Dict[str, float] = {}
        self.elements_differing: Dict[str, int] = {}

    def compare(self, kind: str, ours: torch.Tensor, theirs: torch.Tensor, bound: torch.Tensor, where) -> None:
        diff = (ours.double() - theirs.double()).abs()
        self.ratio.setdefault(kind, 0.0)
        if not diff.numel() or not bool((diff > 0).any()):
            return
        ratio = torch.where(diff > 0, diff / bound, torch.zeros_like(diff))   # x / 0 = inf
        i = int(ratio.argmax())
        self.elements_differing[kind] = self.elements_differing.get(kind, 0) + int((diff > 0).sum())
        self.max_abs_diff[kind] = max(self.max_abs_diff.get(kind, 0.0), float(diff.max()))
        if float(ratio[i]) > self.ratio[kind]:
            self.ratio[kind] = float(ratio[i])
            self.worst[kind] = (f"{where(i)}: {float(ours[i]):.9g} vs stock {float(theirs[i]):.9g}, |diff| "
                                f"{float(diff[i]):.3g}, bound {float(bound[i]):.3g}")


class Forcing:
    """In the AsyncHZP arm: at each step's boundary, compare every rank's reduced gradient partitions with stock's
    for that step against the bound, then write stock's into them; with the stock record's `step`, also the norm
    Stage 3 clips with and the master weights and moments each Adam update leaves. Under optimizer offload the
    host gradients and norms of the parameters AsyncHZP copied at this boundary are taken again from the forced
    partitions, as its boundary copy takes them, and the set it copied must be stock's."""

    def __init__(self, stock: StockRecord):
        self.stock = stock
        self.step = 0
        self.verdict = Verdict()
        self.problems: List[str] = []

    def attach(self, engine, model) -> None:
        optimizer = self.optimizer = engine.optimizer
        self.params = _trainable(optimizer, model)
        self._by_id = {p.ds_id: name for name, p in self.params.items()}
        if set(self.params) != set(self.stock.params):
            self.problems.append(f"trainable parameters {sorted(self.params)} vs stock's {sorted(self.stock.params)}")
        if self.stock.record_step:
            norm_groups, optimizer_step = optimizer._get_norm_groups, optimizer._optimizer_step
            optimizer._get_norm_groups = lambda: self._forced_norm_groups(norm_groups())
            optimizer._optimizer_step = lambda sub_group_id: self._forced_optimizer_step(optimizer_step,
                                                                                         sub_group_id)

    @torch.no_grad()
    def boundary(self) -> None:
        optimizer = self.optimizer
        optimizer.hzp_finish_window_to_read("the fuzzer's gradient comparison")
        record = self.stock.steps[self.step]
        u = unit_roundoff(record["dtype"])
        partitions = getattr(optimizer, STAGE3_GRAD_PARTITION_BY_PARAM_ID)
        offload = optimizer.hzp_offload
        if offload is not None:
            offload.host_wait()
        copied = _offload_norm_names(optimizer, self.params) if offload is not None else set()
        for name, param in self.params.items():
            full, magnitudes, n = record["grads"][name]
            start, real = _partition_slice(optimizer, param)
            partition = partitions[param.ds_id]
            ours, theirs = partition[:real], full[start:start + real]
            self.verdict.compare("gradients", ours, theirs, summation_bound(magnitudes[start:start + real], n, u),
                                 lambda i: f"step {self.step} {name}[{start + i}] (n {n}, sum |x| "
                                           f"{float(magnitudes[start + i]):.3g})")
            ours.copy_(theirs)
            if offload is not None:
                if real and (name in copied) != (name in record["offload_copied"]):
                    self.problems.append(f"step {self.step}: {name}'s gradient copied to the host {name in copied}, "
                                         f"by stock {name in record['offload_copied']}")
                if name in copied:
                    offload_host_grad(optimizer, param).copy_(partition)
                    offload_grad_norm(optimizer, param, partition)

    def after_step(self) -> None:
        self.step += 1

    def _forced_norm_groups(self, ours: list) -> list:
        record = self.stock.steps[self.step]
        theirs = record["norm_groups"]
        mine, stock = float(combine_grad_norm_groups(ours)), float(combine_grad_norm_groups(theirs))
        bound = norm_bound(stock, record["elements"], len(self.params), deepspeed.comm.get_world_size())
        self.verdict.compare("norm", torch.tensor([mine]), torch.tensor([stock]), torch.tensor([bound]),
                             lambda i: f"step {self.step} clipping norm")
        if len(theirs) == len(ours):
            return [t.to(device=o.device, dtype=o.dtype) for t, o in zip(theirs, ours)]
        return [torch.tensor(stock, dtype=ours[0].dtype, device=ours[0].device)]

    @torch.no_grad()
    def _forced_optimizer_step(self, optimizer_step, sub_group_id: int) -> None:
        optimizer = self.optimizer
        flat = optimizer.fp32_partitioned_groups_flat[sub_group_id]
        state = optimizer.optimizer.state.get(flat, {})
        inputs = [flat.detach().double().clone(), flat.grad.detach().double().clone()]
        inputs += [state[key].double().clone() if key in state else torch.zeros_like(inputs[0])
                   for key in ("exp_avg", "exp_avg_sq")]
        optimizer_step(sub_group_id)
        assert getattr(optimizer.optimizer, "adam_w_mode", False), "the Adam bound is AdamW's"
        group = optimizer.optimizer.param_groups[optimizer.sub_group_to_group_id[sub_group_id]]
        assert group.get("bias_correction", True)
        step = int(optimizer.optimizer.state[flat]["step"])
        bounds = adam_update_bound(*inputs, lr=group["lr"], betas=group["betas"], eps=group["eps"],
                                   weight_decay=group["weight_decay"], step=step)
        after = self.stock.steps[self.step]["after"]
        for param in optimizer.fp16_groups[sub_group_id]:
            name = self._by_id[param.ds_id]
            _, offset, _ = optimizer.grad_position[optimizer.get_param_id(param)]
            start, real = _partition_slice(optimizer, param)
            for kind, ours, theirs, bound in zip(("master weights", "exp_avg", "exp_avg_sq"),
                                                 _step_state(optimizer, param), after[name], bounds):
                self.verdict.compare(kind, ours[:real], theirs[start:start + real], bound[offset:offset + real],
                                     lambda i: f"step {self.step} {name}[{start + i}]")
                ours[:real].copy_(theirs[start:start + real])
