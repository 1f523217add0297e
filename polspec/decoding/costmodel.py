"""The hardware cost model: what one round costs on this machine, and which k pays.

Per round, a draft of ``k`` tokens costs ``k c`` target steps (``c`` = draft step / target step),
verifying ``k'`` translated candidates costs ``rho(k' + 1)`` target steps (``rho(m)`` = time of
a target forward over ``m`` tokens / over one; above 1 on bandwidth-bound hardware) and the
translation ``tau`` target steps. With per-candidate acceptance ``a`` a round commits

    E[N] = (1 - a^(k'+1)) / (1 - a)

target tokens, so the speedup over target-only decoding is

    S(a, k) = E[N] / (k c + d + rho(k'+1) + tau)

and speculation pays when ``S > 1``. ``d`` is the draft's work per round beyond its k steps:
its first forward also feeds the text committed last round, and every proposal is a host
sync. ``k'`` follows from ``k`` through the pair's ratio of target candidates to draft tokens
(1 for a same-tokenizer pair). :func:`probe` measures ``c``, ``d``, ``rho(1..9)`` and ``tau``
on the machine at hand; probes are stored per machine and model pair under
``$POLSPEC_HOME/probes``. The ``auto`` draft length (:mod:`polspec.decoding.policy`)
picks the k with the highest predicted S each round, and plain decoding when none exceeds 1.
"""

from __future__ import annotations

import json
import logging
import math
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

from polspec.errors import PolspecError
from polspec.settings import polspec_home

RHO_SIZES = 9  # rho(m) is measured for m = 1..9 and extrapolated linearly beyond
PROBE_FORMAT = 1
BATCH_SIZES = (1, 2, 4, 8, 16)  # sequences per forward in the probe's batch table
BATCH_POSITIONS = (1, 2, 3, 5, 9)  # positions per sequence measured at each batch size

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchCost:
    """Forward times over ``size`` sequences at once, in seconds, with a context cached."""

    size: int
    target_s: tuple[float, ...]  # the target over m positions per sequence, m in BATCH_POSITIONS
    draft_s: float  # the draft over one position per sequence


@dataclass(frozen=True)
class Probe:
    """Measured costs of one target/draft pair on one machine, in target steps."""

    target: str
    draft: str
    c: float
    rho: tuple[float, ...]  # rho[m - 1] for m = 1..RHO_SIZES; rho[0] == 1
    tau: float
    draft_overhead: float = 0.0  # d: draft work per round beyond k c, in target steps
    target_step_s: float = 0.0
    draft_step_s: float = 0.0
    machine: dict[str, str] = field(default_factory=dict)
    batch: tuple[BatchCost, ...] = ()  # the batch table; empty in probes measured before it existed

    def at_batch(self, size: int) -> Probe:
        """The costs of a round over ``size`` sequences, in steps of a plain batched step of that size.

        The batch table is interpolated linearly between measured sizes (extrapolated beyond the
        largest). Translation runs once per sequence, so tau grows with ``size``; the draft's
        per-round work ``d`` is taken as the same time at every size. Without a batch table
        (or at size 1) the probe itself.
        """
        if size < 1:
            raise ValueError(f"a batch holds at least one sequence, got {size}")
        if size == 1 or not self.batch:
            return self
        target = [_interpolate([(b.size, b.target_s[i]) for b in self.batch], size) for i in range(len(BATCH_POSITIONS))]
        step = target[0]
        rho = tuple(_interpolate(list(zip(BATCH_POSITIONS, target)), m) / step for m in range(1, RHO_SIZES + 1))
        draft = _interpolate([(b.size, b.draft_s) for b in self.batch], size)
        seconds = self.target_step_s
        return Probe(self.target, self.draft, c=draft / step, rho=rho, tau=self.tau * seconds * size / step,
                     draft_overhead=self.draft_overhead * seconds / step, target_step_s=step, draft_step_s=draft,
                     machine=self.machine)

    def rho_at(self, m: int) -> float:
        """rho(m), extrapolated linearly from the last two measured sizes beyond them."""
        if m < 1:
            raise ValueError(f"rho is defined for m >= 1, got {m}")
        if m <= len(self.rho):
            return self.rho[m - 1]
        slope = self.rho[-1] - self.rho[-2] if len(self.rho) > 1 else 0.0
        return self.rho[-1] + slope * (m - len(self.rho))

    def as_dict(self) -> dict:
        return asdict(self) | {"rho": list(self.rho), "format": PROBE_FORMAT,
                               "batch": [asdict(b) | {"target_s": list(b.target_s)} for b in self.batch]}

    @classmethod
    def from_dict(cls, data: dict) -> Probe:
        """The probe ``as_dict`` wrote; ValueError when a cost is missing, not a number or negative."""
        fields = {key: value for key, value in data.items() if key != "format"}
        batch = tuple(BatchCost(b["size"], tuple(b["target_s"]), b["draft_s"]) for b in data.get("batch", ()))
        probe = cls(**fields | {"rho": tuple(data["rho"]), "batch": batch})
        if any(len(b.target_s) != len(BATCH_POSITIONS) or not isinstance(b.size, int) or b.size < 1
               or not all(_is_cost(value) and value > 0 for value in (*b.target_s, b.draft_s)) for b in batch):
            raise ValueError(f"a probe's batch table needs a size and {len(BATCH_POSITIONS)} target times and a draft time > 0")
        costs = (probe.c, probe.tau, probe.draft_overhead, *probe.rho)
        if not probe.rho or not all(_is_cost(value) for value in costs):
            raise ValueError("a probe needs c, tau, draft_overhead and rho values, all numbers >= 0")
        return probe


def _interpolate(points: list[tuple[int, float]], x: int) -> float:
    """y at ``x`` on the polyline through ``points`` (sorted by x), extended linearly past both ends."""
    points = sorted(points)
    if len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable")


def _is_cost(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def expected_tokens(a: float, candidates: int) -> float:
    """E[N]: target tokens one round commits with ``candidates`` candidates of acceptance ``a``."""
    if not 0 <= a <= 1:
        raise ValueError(f"acceptance must be in [0, 1], got {a}")
    if a == 1:
        return candidates + 1.0
    return (1 - a ** (candidates + 1)) / (1 - a)


def candidates_for(k: int, ratio: float) -> int:
    """k': target candidates that ``k`` draft tokens become, at ``ratio`` candidates per draft token."""
    return 0 if k == 0 else max(1, round(k * ratio))


def round_cost(probe: Probe, k: int, ratio: float = 1.0) -> float:
    """Cost of one round with ``k`` draft tokens, in target steps (k = 0: plain decoding, 1)."""
    if k == 0:
        return 1.0
    return k * probe.c + probe.draft_overhead + probe.rho_at(candidates_for(k, ratio) + 1) + probe.tau


def predicted_speedup(probe: Probe, a: float, k: int, ratio: float = 1.0) -> float:
    """S(a, k) over target-only decoding; k = 0 is target-only decoding itself (S = 1)."""
    if k == 0:
        return 1.0
    return expected_tokens(a, candidates_for(k, ratio)) / round_cost(probe, k, ratio)


def predicted_speedup_of_rounds(probe: Probe, a: float, k: int, ratio: float, speculative: int, plain: int) -> float:
    """S over a generation of ``speculative`` rounds with ``k`` draft tokens and ``plain``
    target-only steps (``auto`` at k = 0): its expected tokens over its cost, in target steps."""
    tokens = plain + speculative * expected_tokens(a, candidates_for(k, ratio))
    return tokens / (plain + speculative * round_cost(probe, k, ratio))


def break_even_acceptance(probe: Probe, k: int, ratio: float = 1.0) -> float | None:
    """The acceptance at which ``k`` starts to pay (S = 1); None if even a = 1 does not pay."""
    if predicted_speedup(probe, 1.0, k, ratio) <= 1.0:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if predicted_speedup(probe, middle, k, ratio) > 1.0:
            high = middle
        else:
            low = middle
    return high


def best_k(probe: Probe, a: float, k_max: int, ratio: float = 1.0) -> int:
    """The k in 0..k_max with the highest predicted speedup; 0 (plain decoding) when none pays."""
    return max(range(k_max + 1), key=lambda k: (predicted_speedup(probe, a, k, ratio), -k))


def can_pay(probe: Probe, k_max: int, ratio: float = 1.0) -> bool:
    """Whether any k up to ``k_max`` beats plain decoding even with a perfect draft."""
    return any(predicted_speedup(probe, 1.0, k, ratio) > 1.0 for k in range(1, k_max + 1))


# --- measuring -------------------------------------------------------------------------------


def machine_key() -> str:
    """Probes are valid for one machine, backend and dtype policy."""
    from polspec.backend import setup

    chosen = setup()
    return f"{platform.node() or 'host'}-{chosen.kind}-{chosen.device}-{chosen.dtype}"


def probe_path(target: str, draft: str):
    return polspec_home() / "probes" / machine_key() / f"{target}__{draft}.json"


def load_probe(target: str, draft: str) -> Probe | None:
    """The stored probe of this pair on this machine, if one was measured.

    None as well when the file cannot be read as a probe (cut short by a crash, edited by hand):
    a probe is a measurement, so the pair counts as never measured (``auto`` measures it again)
    rather than failing the jobs and reports that read it.
    """
    path = probe_path(target, draft)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return Probe.from_dict(data) if data.get("format") == PROBE_FORMAT else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        log.warning("ignoring unreadable probe %s (%s: %s); treated as never measured", path, type(error).__name__, error)
        return None


def save_probe(probe: Probe) -> None:
    path = probe_path(probe.target, probe.draft)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(probe.as_dict(), indent=1))
    temporary.replace(path)


def probe(target, draft, repeats: int = 9, context: int = 64, batch_sizes: tuple[int, ...] = BATCH_SIZES) -> Probe:
    """Measure c, d, rho(1..9), tau and the batch table for two loaded models on this machine.

    Forward times are medians over ``repeats`` with ``context`` tokens already cached, the
    way decoding runs, every size timed in turn within a repeat; tau is the median time of an
    ``aligned`` translation of a k=4 draft chunk of Polish text, over the target step. The
    batch table times target forwards over B sequences x m positions (m in
    ``BATCH_POSITIONS``) and a draft step over B sequences for every B in ``batch_sizes``
    (a third of ``repeats``, at least 3: the large shapes dominate the probe's time).
    """
    from polspec.backend import setup
    from polspec.decoding.translate import token_bytes, translate_draft_to_target

    if repeats < 1:
        raise PolspecError(f"repeats must be at least 1, got {repeats}")
    target_times = _forward_times(target, range(1, RHO_SIZES + 1), repeats, context)
    step = target_times[0]
    draft_step = _forward_times(draft, [1], repeats, context)[0]

    text = ("Kraków jest jednym z najstarszych miast w Polsce. Przez wieki był stolicą kraju, a jego "
            "Stare Miasto wpisano na listę światowego dziedzictwa UNESCO.")
    target_table, draft_table = token_bytes(target.tokenizer._tokenizer), token_bytes(draft.tokenizer._tokenizer)
    target_ids = target.tokenizer.encode(text)
    draft_ids = draft.tokenizer.encode(text)
    times = []
    for start in range(4, len(draft_ids) - 4, 3):
        clock = time.perf_counter()
        translate_draft_to_target("aligned", draft_table, target_table, draft_ids[start:start + 4],
                                  target_ids[: max(1, start)], 5, 10)
        times.append(time.perf_counter() - clock)
    batch_repeats = max(3, repeats // 3)
    batch = tuple(BatchCost(size, tuple(_batch_forward_times(target, size, BATCH_POSITIONS, batch_repeats, context)),
                            _batch_forward_times(draft, size, [1], batch_repeats, context)[0])
                  for size in batch_sizes)
    chosen = setup()
    return Probe(target.entry.alias, draft.entry.alias, c=draft_step / step, batch=batch,
                 rho=tuple(t / step for t in target_times), tau=statistics.median(times) / step,
                 draft_overhead=max(0.0, _draft_round_time(draft, draft_ids, repeats) - draft_step) / step,
                 target_step_s=step, draft_step_s=draft_step,
                 machine={"key": machine_key(), "platform": chosen.platform, "device": chosen.device,
                          "dtype": chosen.dtype, "mlx": chosen.mlx_version})


def _draft_round_time(draft, text_ids: list[int], repeats: int) -> float:
    """Median time of a real one-token proposal round of the decoder's draft side.

    Each round first re-syncs the draft with two more tokens of committed text, as after a
    round that accepted one candidate and added the target's own token, then proposes one
    token; the difference from a bare draft step is the per-round overhead ``d``.
    """
    from polspec.decoding.params import DecodingParams
    from polspec.decoding.policy import DraftLength
    from polspec.decoding.speculative import _DraftSide

    prompt, rest = text_ids[:8], text_ids[8:]
    side = _DraftSide(draft, prompt, len(text_ids) + 4, None)
    policy = DraftLength(DecodingParams(k=1))
    side.propose(1, policy)  # feeds the prompt: not a round
    times = []
    for round_ in range(min(repeats, (len(rest) - 1) // 2)):
        side.resync(rest[: 2 * round_ + 2], b"")
        clock = time.perf_counter()
        side.propose(1, policy)
        times.append(time.perf_counter() - clock)
    return statistics.median(times)


def _forward_times(loaded, sizes, repeats: int, context: int) -> list[float]:
    """Median time of a forward over m tokens for each m in ``sizes``, ``context`` tokens cached.

    The sizes are timed in turn within each repeat, so that a change in the machine's load
    during the probe shifts every size alike and the ratios rho(m) stay sound.
    """
    import mlx.core as mx

    from polspec.decoding.kv import new_cache, prefill, trim

    sizes = list(sizes)
    caches = []
    for m in sizes:
        cache = new_cache(loaded.model, loaded.entry.alias, context + m + 1)
        prefill(loaded.model, cache, list(range(1, context + 1)))
        caches.append(cache)
    inputs = [mx.array([list(range(2, m + 2))]) for m in sizes]
    return _median_times(loaded.model, inputs, caches, [lambda cache, m=m: trim(cache, m) for m in sizes], repeats)


def _batch_forward_times(loaded, size: int, positions, repeats: int, context: int) -> list[float]:
    """Median time of a forward over ``size`` sequences x m positions for each m in ``positions``,
    through the batched decoder's ragged cache, ``context`` tokens cached per sequence."""
    import mlx.core as mx

    from polspec.decoding import batch_kv

    layers = batch_kv.check_batchable(loaded.model, loaded.entry.alias)
    positions = list(positions)
    caches = [batch_kv.join(None, [batch_kv.prefill_one(loaded.model, layers, list(range(1, context + 1)))
                                   for _ in range(size)]) for _ in positions]
    inputs = [mx.array([list(range(2, m + 2))] * size) for m in positions]
    undo = [lambda cache, m=m: batch_kv.trim_each(cache, [m] * size) for m in positions]
    return _median_times(loaded.model, inputs, caches, undo, repeats)


def _median_times(model, inputs: list, caches: list, undo: list, repeats: int) -> list[float]:
    """Median time of ``model`` over each input with its cache, all inputs in turn within a repeat;
    ``undo[i](cache)`` takes the forward's entries out of the cache again, untimed."""
    import mlx.core as mx

    times: list[list[float]] = [[] for _ in inputs]
    for round_ in range(repeats + 1):  # the first round warms each shape up and is not kept
        for index, (tokens, cache) in enumerate(zip(inputs, caches)):
            clock = time.perf_counter()
            mx.eval(model(tokens, cache=cache))
            if round_:
                times[index].append(time.perf_counter() - clock)
            undo[index](cache)
    return [statistics.median(values) for values in times]


@dataclass
class AcceptanceEstimate:
    """A running estimate of per-candidate acceptance for one pair and strategy.

    Each round adds its accepted candidates as successes and, if it stopped at a rejection,
    one failure: the maximum-likelihood estimate of a geometric acceptance process, which a
    plain accepted/proposed ratio underestimates. Starts from a weak prior of ``a = 0.5``.
    """

    successes: float = 1.0
    failures: float = 1.0

    @property
    def a(self) -> float:
        return self.successes / (self.successes + self.failures)

    def observe(self, accepted: int, candidates: int) -> None:
        self.successes += accepted
        self.failures += 1 if accepted < candidates else 0


# One estimate per (target, draft, translation) for the life of the process, so that a worker's
# later generations start from what earlier ones saw.
_ESTIMATES: dict[tuple[str, str, str], AcceptanceEstimate] = {}


def acceptance_estimate(target: str, draft: str, translation: str) -> AcceptanceEstimate:
    """The running estimate for a pair and a translation (a strategy; ``aligned/hold`` apart from
    ``aligned/verify``, whose candidates are accepted at different rates)."""
    return _ESTIMATES.setdefault((target, draft, translation), AcceptanceEstimate())
