"""The policy losses: one registered function each, with its facts beside it.

A policy loss is the policy-gradient term pg of `fastpo.kernels.torch_reference.policy_loss_terms`:
from each token's ratio, log-prob, old log-prob, advantage and entropy (`PolicyLossInputs`,
[N] tensors) it returns pg [N] (a loss: lower is better) and the tokens it clipped
(`PolicyGradient`). What surrounds it is the same for every loss and written once there: the
ratio (PPO's per token, or GSPO's per sequence), the dual clip, importance-sampling weights,
the entropy bonus, the KL term, the aggregation. The facts registered with the function are
what the settings check (`PolicyLossSettings.check`), the config (`algorithm.policy_loss` and
the keys of each loss's own settings), the fused paths (`linear_policy_loss`) and the trainer
read; none of them compares a loss's name.

A new loss is one decorated function, here or in the user's own module (imported before the
config is loaded):

    @register_policy_loss("scaled_pg", settings=(LossSetting("pg_scale", 1.0, lambda v: v > 0, "must be > 0",
                                                              "the policy gradient's scale"),))
    def scaled_pg(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyGradient:
        return PolicyGradient(-x.advantages * x.ratio * s.pg_scale)

It is then `algorithm.policy_loss=scaled_pg algorithm.pg_scale=0.5` in a config and
`linear_policy_loss(..., loss="scaled_pg", settings=PolicyLossSettings(loss="scaled_pg", pg_scale=0.5))`
in the library; docs/algorithms.md ("Adding a policy loss") walks through it.
"""
from __future__ import annotations

import dataclasses
import math
import types
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch

LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATORS = ("k1", "k3")
# "token": PPO's per-token ratio; "sequence": GSPO's length-normalised sequence ratio.
RATIO_LEVELS = ("token", "sequence")
# Log-ratios are clamped to this range before exp(): a token whose probability moved by
# more than e^20 would otherwise overflow the ratio (and its gradient) to inf.
LOG_RATIO_CLAMP = 20.0


@dataclasses.dataclass(frozen=True)
class PolicyLossInputs:
    """What a policy loss reads, per token: N tokens, every tensor [N] on one device, fp32 (fp64
    for fp64 inputs). logprob and entropy carry the gradient; the others are constants.

    logprob: log pi(y_t) of the current policy (nats). old_logprob: log pi_old(y_t), the policy
    that sampled (nats). ratio: the ratio r the loss clips: exp(logprob - old_logprob) per token,
    or GSPO's sequence ratio (value s_i, gradient through logprob_t: `policy_loss_terms`), its
    log clamped to +-LOG_RATIO_CLAMP. advantages: A. entropy: the token's entropy (nats).
    selected: bool [N], the tokens the loss's `select` chose over the whole call (None for a
    loss without one).
    """

    logprob: torch.Tensor
    old_logprob: torch.Tensor
    ratio: torch.Tensor
    advantages: torch.Tensor
    entropy: torch.Tensor
    selected: Optional[torch.Tensor] = None


class PolicyGradient(NamedTuple):
    """A policy loss's result. pg: [N] the per-token policy-gradient term, a loss (lower is
    better), differentiable through `PolicyLossInputs.logprob` / `entropy`. clip_low /
    clip_high: bool [N], the tokens whose lower / upper clip is active (their shares are
    `clipfrac_low` / `clipfrac_high`); None for a loss without a clip. fractions:
    {metric name: bool [N]}, further per-token events whose share of the scored tokens is
    logged as that metric (Clip-Cov's and KL-Cov's "covfrac"), or None."""

    pg: torch.Tensor
    clip_low: Optional[torch.Tensor] = None
    clip_high: Optional[torch.Tensor] = None
    fractions: Optional[Mapping[str, torch.Tensor]] = None


@dataclasses.dataclass(frozen=True)
class LossSetting:
    """One setting of a policy loss beyond the shared ones of `PolicyLossSettings`: a keyword
    of `PolicyLossSettings` and the config key `algorithm.<name>`.

    name: a Python identifier. default: its value when not given (an int or a finite float).
    ok(value) -> bool: its rule, for a value of its kind (ints are accepted as floats; floats
    must be finite). why: the rule in words, as the one-line error says it ("must be > 0").
    doc: what it means, one sentence (docs/configuration.md). kind: float or int. Several
    losses may take one setting (Clip-Cov's and KL-Cov's `cov_ratio`): they give the same
    LossSetting object.
    """

    name: str
    default: Any
    ok: Callable[[Any], bool] = lambda v: True
    why: str = ""
    doc: str = ""
    kind: type = float

    def problem(self, value: Any) -> Optional[str]:
        """None when `value` is a good value of this setting, else what is wrong ("must be ...")."""
        if self.kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                return "must be an integer"
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return "must be a finite number"
        return None if self.ok(value) else self.why


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss (`register_policy_loss`) and its facts.

    fn(PolicyLossInputs, PolicyLossSettings) -> PolicyGradient: the loss. dual_clip: takes
    PPO's dual clip (settings.dual_clip, applied by `policy_loss_terms` to its pg; the other
    losses refuse one, and the trainer leaves algorithm.dual_clip unused for them).
    sequence_ratio: defined with GSPO's sequence ratio (ratio_level "sequence").
    clip_range: clip_low < 1 and clip_high >= clip_low are required (PPO's clip range); False
    lets any bounds >= 0 through (CISPO's IS weight, which may go without a lower bound).
    select(logprob, old_logprob, advantages, loss_mask, settings) -> bool [N]: a token choice
    from statistics of the whole call (all [N], taken before any term is formed; the trainer
    calls once per micro-batch, with a fresh `settings.cov_seed` each call), passed to fn as
    `selected`; None for a loss that has none. settings: its own settings (`LossSetting`).
    check(values) -> None or (name, why): a rule relating its settings (`values`: every
    registered setting by name), naming the setting it blames. paper: where it comes from.
    """

    name: str
    fn: Callable[[PolicyLossInputs, "PolicyLossSettings"], PolicyGradient]
    dual_clip: bool = False
    sequence_ratio: bool = False
    clip_range: bool = True
    select: Optional[Callable[..., torch.Tensor]] = None
    settings: tuple[LossSetting, ...] = ()
    check: Optional[Callable[[Mapping[str, Any]], Optional[tuple[str, str]]]] = None
    paper: str = ""


_LOSSES: dict[str, PolicyLoss] = {}
#: The registered policy losses by name, in registration order (read-only; `register_policy_loss` adds one).
POLICY_LOSSES: Mapping[str, PolicyLoss] = types.MappingProxyType(_LOSSES)


def register_policy_loss(name: str, *, dual_clip: bool = False, sequence_ratio: bool = False, clip_range: bool = True,
                         select: Optional[Callable[..., torch.Tensor]] = None, settings: tuple = (),
                         check: Optional[Callable[[Mapping[str, Any]], Optional[tuple[str, str]]]] = None,
                         paper: str = ""):
    """Decorator: register `fn(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyGradient`
    as policy loss `name`, with the facts of `PolicyLoss` (keywords of the same names).

    Afterwards `name` is a value of `algorithm.policy_loss` and of `PolicyLossSettings.loss`,
    each of `settings` a config key `algorithm.<setting>` and a `PolicyLossSettings` keyword
    (read in fn as `s.<setting>`), checked by its rule wherever settings are built. Register
    before the config is loaded. Returns fn unchanged.

    Raises ValueError naming the problem: a name that is not an identifier or is taken, a
    setting that is not a LossSetting, shadows a shared setting (clip_low, ...), is declared
    twice, differs from another loss's setting of that name, or whose default breaks its rule.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a policy loss's name must be a Python identifier, got {name!r}")
    if name in _LOSSES:
        raise ValueError(f"policy loss {name!r} is registered already")
    settings = tuple(settings)
    shared = {f.name for f in dataclasses.fields(PolicyLossSettings)}
    known = loss_settings()
    for s in settings:
        if not isinstance(s, LossSetting):
            raise ValueError(f"policy loss {name!r}: settings must be LossSetting objects, got {s!r}")
    for s in settings:
        if not isinstance(s.name, str) or not s.name.isidentifier() or s.name in shared:
            raise ValueError(f"policy loss {name!r}: setting name {s.name!r} must be an identifier other than the "
                             f"shared settings ({', '.join(sorted(shared))})")
        if [t.name for t in settings].count(s.name) > 1:
            raise ValueError(f"policy loss {name!r} declares setting {s.name!r} twice")
        if s.name in known and known[s.name] is not s:
            raise ValueError(f"policy loss {name!r}: setting {s.name!r} is another loss's already; give the same "
                             "LossSetting object to both")
        problem = s.problem(s.default)
        if problem is not None:
            raise ValueError(f"policy loss {name!r}: the default of {s.name} {problem}, got {s.default!r}")

    def add(fn):
        if not callable(fn):
            raise ValueError(f"policy loss {name!r}: register a function, got {fn!r}")
        _LOSSES[name] = PolicyLoss(name, fn, dual_clip, sequence_ratio, clip_range, select, settings, check, paper)
        return fn

    return add


def policy_loss(name: str) -> PolicyLoss:
    """The registered policy loss `name`; ValueError naming it and the registered ones otherwise."""
    if name not in _LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose from {', '.join(_LOSSES)}")
    return _LOSSES[name]


def loss_settings() -> dict[str, LossSetting]:
    """Every registered loss's own settings by name, in registration order (a setting two losses
    take once)."""
    out: dict[str, LossSetting] = {}
    for loss in _LOSSES.values():
        for s in loss.settings:
            out.setdefault(s.name, s)
    return out


def settings_problem(values: Mapping[str, Any]) -> Optional[tuple[str, Any, str]]:
    """The first registered loss setting that breaks its rule, or its loss's `check`, as (name,
    value, why), with `values` by name (a setting missing there: its default); None when all
    are good. Every registered loss's settings are checked, whichever loss is used (one rule
    for a config however it later picks its loss). The settings check and the config's
    validation both ask here, and word the error their way."""
    declared = loss_settings()
    full = {n: values.get(n, s.default) for n, s in declared.items()}
    for n, s in declared.items():
        why = s.problem(full[n])
        if why is not None:
            return n, full[n], why
    for loss in _LOSSES.values():
        found = loss.check(full) if loss.check is not None else None
        if found is not None:
            return found[0], full[found[0]], found[1]
    return None


def _takers(fact: str) -> str:
    """The registered losses with `fact` set, as "'ppo' or 'clip_cov'"."""
    return " or ".join(repr(n) for n, loss in _LOSSES.items() if getattr(loss, fact))


@dataclasses.dataclass(frozen=True, init=False)
class PolicyLossSettings:
    """The policy loss's settings as one object (Liger keeps them on its loss module): what
    `linear_policy_loss` also takes one keyword each (`settings=`), with the same defaults and
    meaning (see `fastpo.kernels.torch_reference.policy_loss_terms` and `aggregation_weights`):
    clip_low / clip_high >= 0, clip_low < 1 and clip_high >= clip_low (PPO's clip range, DAPO's
    clip-higher; any bounds for a loss without that range, `PolicyLoss.clip_range`), dual_clip
    None or > 1 (only for a loss that takes it), entropy_coef and kl_coef >= 0, kl_estimator in
    KL_ESTIMATORS, temperature > 0 (the logits' divisor), loss_agg in LOSS_AGGS, ratio_level in
    RATIO_LEVELS ("sequence" only for a loss defined with it); `loss`, a registered policy loss
    (`POLICY_LOSSES`); cov_seed >= 0, the seed of a loss's random token choice (Clip-Cov's, see
    `PolicyLoss.select`). The registered losses' own settings are keywords too
    (`PolicyLossSettings(loss="sapo", sapo_tau_pos=1.0)`), read as attributes (`s.sapo_tau_pos`),
    kept in `options` ((name, value) pairs, every registered one, defaults filled in).

    Checked when built (`check`): a bad setting raises ValueError with a one-line message
    naming the value; an unknown keyword raises TypeError. The defaults are verl's (clip 0.2 /
    0.2, no entropy bonus, the k3 KL estimator, token-mean), so that a loss moved from verl or
    TRL computes the same objective; fastpo's trainer builds its own from its config (0.2 /
    0.28, entropy 0.001, k1, seq-mean-token-mean: the StarPO-S paper's), see
    `fastpo.trainer.update.policy_loss_settings`.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    temperature: float = 1.0
    loss_agg: str = "token-mean"
    ratio_level: str = "token"
    loss: str = "ppo"
    cov_seed: int = 0
    options: tuple = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # the shared settings by position or keyword (the fields' order and defaults), the
        # registered losses' own by keyword or in `options`
        shared = [f for f in dataclasses.fields(self) if f.name != "options"]
        if len(args) > len(shared):
            raise TypeError(f"PolicyLossSettings takes at most {len(shared)} positional settings, got {len(args)}")
        values = {f.name: f.default for f in shared}
        for f, v in zip(shared, args):
            values[f.name] = v
        for f in shared[len(args):]:
            values[f.name] = kwargs.pop(f.name, values[f.name])
        own = {**dict(kwargs.pop("options", ())), **kwargs}
        declared = loss_settings()
        for k in own:
            if k not in declared:
                raise TypeError(f"unknown policy-loss setting {k!r}: the shared ones are {', '.join(values)}; the "
                                f"registered losses' own are {', '.join(declared) or 'none'}")
        for k, v in values.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "options", tuple((n, own.get(n, s.default)) for n, s in declared.items()))
        self.check()

    def __getattr__(self, name: str) -> Any:
        # a registered loss's own setting (s.sapo_tau_pos); one registered after these settings
        # were built has its default
        if not name.startswith("_") and "options" in self.__dict__:
            for k, v in self.options:
                if k == name:
                    return v
            declared = loss_settings().get(name)
            if declared is not None:
                return declared.default
        raise AttributeError(f"'PolicyLossSettings' object has no attribute {name!r}")

    def check(self) -> None:
        """Raise ValueError naming the first bad setting (temperature is checked with the
        hidden states, by the caller)."""
        if self.ratio_level not in RATIO_LEVELS:
            raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {self.ratio_level!r}")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {self.loss_agg!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        for name in ("clip_low", "clip_high", "entropy_coef", "kl_coef"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.loss not in _LOSSES:
            raise ValueError(f"loss must be one of {tuple(_LOSSES)}, got {self.loss!r}")
        loss = _LOSSES[self.loss]
        # CISPO's IS weight may go without a lower bound (its paper's setting): clip_low >= 1 puts
        # 1 - clip_low at or below 0, under every ratio; PPO's clip range must stay a range
        if self.clip_low >= 1.0 and loss.clip_range:
            raise ValueError(f"clip_low must be < 1 (the ratio's lower bound is 1 - clip_low), got {self.clip_low}")
        if self.clip_high < self.clip_low and loss.clip_range:
            raise ValueError(f"clip_high must be >= clip_low (clip-higher widens the upper bound), got clip_high="
                             f"{self.clip_high} < clip_low={self.clip_low}")
        d = self.dual_clip
        if d is not None and not (isinstance(d, (int, float)) and math.isfinite(d) and d > 1.0):
            raise ValueError(f"dual_clip must be None or a finite constant > 1, got {d!r}")
        if d is not None and not loss.dual_clip:
            raise ValueError(f"dual_clip={d} applies to PPO's clipped surrogate (loss {_takers('dual_clip')}), not "
                             f"loss={self.loss!r}; use dual_clip=None")
        if self.ratio_level == "sequence" and not loss.sequence_ratio:
            raise ValueError(f"ratio_level='sequence' (GSPO) is defined for loss {_takers('sequence_ratio')}, not "
                             f"loss={self.loss!r}")
        s = self.cov_seed
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"cov_seed must be an integer >= 0, got {s!r}")
        problem = settings_problem(dict(self.options))
        if problem is not None:
            name, value, why = problem
            raise ValueError(f"{name} {why}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# The built-in losses. With r the ratio, A the advantage and sg a stop-gradient, per token.
# ---------------------------------------------------------------------------------------------


@register_policy_loss("ppo", dual_clip=True, sequence_ratio=True,
                      paper="PPO's clipped surrogate with clip-higher (arXiv 1707.06347, DAPO arXiv 2503.14476)")
def ppo(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyGradient:
    """pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) (PPO, Schulman et al. 2017, eq. 7,
    with separate low/high epsilons: "clip-higher", DAPO arXiv 2503.14476); the dual clip
    (Ye et al. 2020, arXiv 1912.09729) is `policy_loss_terms`'."""
    pg_unclipped = -x.advantages * x.ratio
    pg_clipped = -x.advantages * x.ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    return PolicyGradient(pg, clipped & (x.ratio < 1.0), clipped & (x.ratio > 1.0))


@register_policy_loss("cispo", sequence_ratio=True, clip_range=False,
                      paper="the clipped IS weight, detached, times A log pi (CISPO, MiniMax-M1 arXiv 2506.13585)")
def cispo(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyGradient:
    """MiniMax-M1 (arXiv 2506.13585, eq. 4): pg = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A *
    logprob. The IS weight is clipped and detached; every token keeps the gradient of its
    log-prob (PPO's clip zeroes it for a token that moved too far). The paper sets no lower
    bound (a large eps_low): clip_low >= 1. Its value holds logprob itself, so pg is not
    comparable to PPO's in size. Clipped: r below 1 - clip_low, above 1 + clip_high."""
    r = x.ratio.detach()
    pg = -x.advantages * r.clamp(1.0 - s.clip_low, 1.0 + s.clip_high) * x.logprob
    return PolicyGradient(pg, r < 1.0 - s.clip_low, r > 1.0 + s.clip_high)


#: SAPO's gate is (4 / tau) sigmoid(tau (r - 1)): a smaller tau overflows float32 (an inf loss).
SAPO_TAU_MIN = 4 / torch.finfo(torch.float32).max
_SAPO_TAU_WHY = f"must be >= {SAPO_TAU_MIN:.3g} (SAPO's gate scale 4 / tau must be finite in float32)"
SAPO_TAU_POS = LossSetting("sapo_tau_pos", 1.0, lambda v: v >= SAPO_TAU_MIN, _SAPO_TAU_WHY,
                           "SAPO's gate temperature for tokens with a positive advantage.")
SAPO_TAU_NEG = LossSetting("sapo_tau_neg", 1.05, lambda v: v >= SAPO_TAU_MIN, _SAPO_TAU_WHY,
                           "SAPO's gate temperature for the other tokens.")


@register_policy_loss("sapo", settings=(SAPO_TAU_POS, SAPO_TAU_NEG),
                      paper="a soft sigmoid gate on the ratio, temperatures by the advantage's sign (SAPO, arXiv "
                            "2511.20347)")
def sapo(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyGradient:
    """Soft Adaptive Policy Optimization (arXiv 2511.20347): pg = -A * f(r) with the soft gate
    f(r) = (4 / tau) * sigmoid(tau * (r - 1)), tau = sapo_tau_pos where A > 0, sapo_tau_neg
    elsewhere (verl's 1.0 / 1.05); f(1) = 2 / tau, f'(1) = 1 (the on-policy gradient is PPO's),
    and the gradient fades smoothly as r leaves 1 instead of stopping at a clip. No clip."""
    tau_pos, tau_neg = (torch.tensor(t, dtype=x.ratio.dtype, device=x.ratio.device)
                        for t in (s.sapo_tau_pos, s.sapo_tau_neg))
    tau = torch.where(x.advantages > 0, tau_pos, tau_neg)
    return PolicyGradient(-x.advantages * (4.0 / tau) * torch.sigmoid(tau * (x.ratio - 1.0)))


# Clip-Cov and KL-Cov (arXiv 2505.22617) act on the tokens whose log-prob and advantage co-vary most.
COV_RATIO = LossSetting("cov_ratio", 0.0002, lambda v: 0 < v <= 1, "must be in (0, 1]",
                        "the share of a micro-batch's scored tokens Clip-Cov / KL-Cov act on (at least one token).")
CLIP_COV_LB = LossSetting("clip_cov_lb", 1.0, doc="Clip-Cov's covariance band, lower end.")
CLIP_COV_UB = LossSetting("clip_cov_ub", 5.0, doc="Clip-Cov's covariance band, upper end.")
KL_COV_COEF = LossSetting("kl_cov_coef", 1.0, lambda v: v > 0, "must be > 0", "KL-Cov's penalty weight.")


def _covariance(logprob: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor, cov_ratio: float):
    """(masked-in bool [N], log-prob fp64 [N], advantage fp64 [N], cov fp64 [N], k), or None when
    no token is masked in: each token's centred covariance between log-prob and advantage,
    cov_i = (A_i - mean A) (logprob_i - mean logprob) over the n masked-in tokens, and the
    number of tokens to choose, k = max(1, floor(cov_ratio * n))."""
    sel = loss_mask.to(torch.float32) > 0
    lp = logprob.detach().to(torch.float64)
    adv = advantages.detach().to(torch.float64)
    n = int(sel.sum())
    if n == 0:
        return None
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    cov = (torch.where(sel, adv, zero) - adv[sel].mean()) * (torch.where(sel, lp, zero) - lp[sel].mean())
    return sel, lp, adv, cov, max(1, int(cov_ratio * n))


def clip_cov_selection(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
                       loss_mask: torch.Tensor, settings: PolicyLossSettings) -> torch.Tensor:
    """The tokens Clip-Cov detaches (arXiv 2505.22617, Alg. 1, as verl computes it): k of them
    (`_covariance`) drawn at random (torch.randperm with a generator seeded by settings.cov_seed,
    on the CPU) among the tokens with clip_cov_lb < cov_i < clip_cov_ub that PPO's clip does not
    already cover (all of them when fewer). logprob, old_logprob, advantages [N] float (nats;
    detached here), loss_mask [N] bool/float. Returns bool [N], False off the mask."""
    s = settings
    chosen = torch.zeros_like(loss_mask.to(torch.float32) > 0)
    found = _covariance(logprob, advantages, loss_mask, s.cov_ratio)
    if found is None:
        return chosen
    sel, lp, adv, cov, k = found
    ratio = torch.exp((lp - old_logprob.detach().to(lp.dtype)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = -adv * ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high) > -adv * ratio
    band = sel & ~clipped & (cov > s.clip_cov_lb) & (cov < s.clip_cov_ub)
    candidates = torch.nonzero(band).reshape(-1)
    order = torch.randperm(candidates.numel(), generator=torch.Generator().manual_seed(s.cov_seed))
    chosen[candidates[order[:k].to(candidates.device)]] = True
    return chosen


def kl_cov_selection(logprob: torch.Tensor, old_logprob: torch.Tensor, advantages: torch.Tensor,
                     loss_mask: torch.Tensor, settings: PolicyLossSettings) -> torch.Tensor:
    """The tokens KL-Cov penalises (arXiv 2505.22617, Alg. 2, as verl computes it): the k with
    the largest cov_i (`_covariance`). Arguments and result as `clip_cov_selection`'s."""
    chosen = torch.zeros_like(loss_mask.to(torch.float32) > 0)
    found = _covariance(logprob, advantages, loss_mask, settings.cov_ratio)
    if found is None:
        return chosen
    sel, _, _, cov, k = found
    chosen[torch.topk(torch.where(sel, cov, -torch.inf), k).indices] = True
    return chosen


def _band_is_a_band(v: Mapping[str, Any]) -> Optional[tuple[str, str]]:
    return None if v["clip_cov_lb"] < v["clip_cov_ub"] else ("clip_cov_lb", f"must be below clip_cov_ub "
                                                                             f"({v['clip_cov_ub']})")


@register_policy_loss("clip_cov", dual_clip=True, select=clip_cov_selection,
                      settings=(COV_RATIO, CLIP_COV_LB, CLIP_COV_UB), check=_band_is_a_band,
                      paper="PPO with a few high-covariance tokens detached (Clip-Cov, arXiv 2505.22617)")
def clip_cov(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyGradient:
    """arXiv 2505.22617, Alg. 1: PPO's pg, with the tokens of `selected` (`clip_cov_selection`)
    detached: their pg keeps its value, their gradient is 0. Logs their share as "covfrac"."""
    g = ppo(x, s)
    chosen = x.selected.bool()
    return g._replace(pg=torch.where(chosen, g.pg.detach(), g.pg), fractions={"covfrac": chosen})


@register_policy_loss("kl_cov", select=kl_cov_selection, settings=(COV_RATIO, KL_COV_COEF),
                      paper="the unclipped surrogate with |log r| on the highest-covariance tokens (KL-Cov, arXiv "
                            "2505.22617)")
def kl_cov(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyGradient:
    """arXiv 2505.22617, Alg. 2: the unclipped pg = -A r, plus kl_cov_coef * |logprob -
    old_logprob| on the tokens of `selected` (`kl_cov_selection`). Logs their share as "covfrac"."""
    pg = -x.advantages * x.ratio
    chosen = x.selected.bool()
    penalty = s.kl_cov_coef * (x.logprob - x.old_logprob).abs()
    return PolicyGradient(torch.where(chosen, pg + penalty, pg), fractions={"covfrac": chosen})
