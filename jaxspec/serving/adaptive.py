"""Adaptive speculation: per segment, the draft shape the cost model predicts fastest for the rows generating now.

Plain Python (the scheduler's: no jax). The candidates are a few compiled shapes (plain decoding and one chain, as
`jaxspec serve --num-steps auto` sets them, or plain decoding and a tree with --topk) that all run on the executor's
one loop state. What the policy learns,
online, from the executor's `StepResult`s:
- per (shape, row bucket, context range), the seconds one cycle takes T: the median of the last RECENT measurements
  (segment seconds over the cycles it ran; a median, as one segment can take several times the others: the first run
  of a program, other work on the machine); no tune.json needed: the first segments measure it;
- the drafter's conditional acceptance per draft position a_j: the per-position reached / accepted counters, decayed
  by DECAY per drafting segment (a chain's a_j is a property of the drafter on the traffic, not of its depth, so
  every chain shares them; a tree's, how often depth j is accepted once reached, are its own: it is then the one
  drafting candidate), over all traffic and per context range; and apart for rows fed the drafter at prefill and
  rows not (`feeds_drafter`; each row's own counters tell them apart): a chain on an unfed row drafts with no drafter
  entries for its prompt and accepts less (the bundled pair at 128 tokens: a_j 0.56, 0.40, 0 on a fresh server's
  first, unfed row, 0.73, 0.80, 0.85 on the fed rows after it). The unfed rows' a_j take the fed rows' as their prior
  (as a range's take every range's, below); a recorded acceptance is a fed row's. A segment's E is its rows' mean,
  each row's by its own.
The context range of a segment is `context_range` of its longest generating row's live length (prompt and tokens so
far: what the scheduler knows, not the compiled context bucket): ranges of CONTEXT_RANGE positions, then each 4x
longer. A cycle costs more as the context grows and a drafter accepts less far from what it was trained on, so a long
conversation can stop paying for speculation while short ones still do: each range is predicted from its own
measurements, and a range not measured yet from the nearest one measured at that bucket (T scaled by how much the
other shapes' T changed between the two ranges; a_j: the range's own counters with the overall a_j as a prior worth
PRIOR_ROW_CYCLES row-cycles, the deeper positions' scaled as the range's a_1 moved from the overall a_1), so a new
range starts from what is known and costs no learning segments.
A segment over a bucket of rows, n of them generating, runs the shape of highest predicted throughput n E / T (the
cost model's R with E = 1 + sum_j prod_{i<=j} a_i; plain decoding: E = 1). A fresh server starts from what is known
before its first request, so its first segments already run the predicted best: each shape's cycle time per row
bucket timed at warm-up (`calibrate`: the engine runs every compiled shape over live rows of every bucket once more
after compiling it, a calibration measurement standing for FIRST online ones; a shape not timed online yet keeps its
calibration scaled by how much the shapes timed online moved from theirs), and the drafter's recorded acceptance
(`prior`: tune.json's measured a_j, a prior worth PRIOR_ROW_CYCLES row-cycles which the online counters outweigh after
a few segments; its deeper positions scaled as the traffic's a_1 moves from its a_1, as a range's prior is).
Learning what a shape costs costs time where it loses, so:
- a draft position whose acceptance nothing has measured or given is predicted accepted UNKNOWN_ACCEPTANCE of the
  time (the mean of a uniform prior on it), so a drafter with no recorded acceptance is tried first only where that
  predicts it to win (on the bundled target over 1 row, not over 8), and elsewhere explored like any candidate
  predicted to lose (below): its first measure costing the stated share, not a whole first segment (a probe over 8
  rows of a drafter that accepts nothing took 31 ms where a plain segment of 4 cycles took 17, in a fresh server's
  load of about 0.9 s);
- a chain chosen before its acceptance was measured on this traffic (on a recorded or unknown acceptance) runs a probe
  of one cycle (`probing`, a segment that is timed as no other), so that a prior of other prompts costs one cycle where
  the traffic disagrees (on HumanEval the bundled chain's first segment over 8 rows took 2.7x a plain one's);
- a candidate not yet timed at that bucket runs first; one timed fewer than FIRST times there (and not calibrated)
  runs again unless it is predicted below LOSING x the best (a single measurement would have to be over 1 / LOSING
  times too slow to hide the fastest shape); the candidates timed fewest times run first, so their measurements
  interleave;
- afterwards a candidate that is not chosen runs again once the time spent without it reaches its own segment time x
  (the best prediction / its prediction) / EXPLORE_SHARE (its cost, and a chain's acceptance, would go stale
  otherwise). A candidate at x = its prediction / the best's then takes about EXPLORE_SHARE x x of the time and
  loses 1 - x of it: exploring costs at most EXPLORE_SHARE / 4 of the throughput, and the worse a shape looks, the
  less often it is tried.
A row is fed the drafter at prefill (`feeds_drafter`) only where a chain is predicted at FEED x plain decoding's
throughput or more, in its prompt's context range, at the row bucket that will serve it (the rows generating or queued
when it is admitted, itself included: at the nearest bucket where both were timed), with a fed row's acceptance, once a
chain has measured the drafter on this server's traffic: a recorded acceptance (`prior`) chooses shapes, but never feeds
a row before then; and until a chain has measured it on a fed row, one row only (a fresh server's first rows are not
fed, and their chains measure an unfed row's acceptance: with the two counted together, the long-context benchmark's
first request ended with the chain predicted at 1.07x plain decoding in one run, and under 1 in two runs of seven, where
every next request went unfed and plain, 0.86 of the chain; one row, as the recorded acceptance a fed row is then
predicted by can be of other prompts: with every other row fed on it, the fresh-server benchmark's HumanEval load at 8
rows fell to 0.887 of plain decoding in its one run, against 0.936-0.953 before), and that row, as every FEED_EVERY-th
admission until then, only where a chain is predicted over the rows it joins as they are (it fed, the others fed or
not as they were: a segment's E is its rows' mean; a row fed beside unfed rows whose acceptance keeps the bucket plain
sees no chain, and the fresh-server benchmark's HumanEval load at 8 rows paid its drafter's prefill, 1.3-2.0% of the
load, for none). Else its prefill runs no drafter at all (a chain that later runs on the row drafts from the prompt's
last position on: the drafter-alone step at prefill took 8.7% of a prefill program over 8 unfed rows). The drafter's
prefill over the whole prompt is a cost paid for chains (`python benchmarks/serve_feed.py`, bundled pair, 128-token
prompts: 16-18% of a fed prompt's prefill; a long prompt's prefill is most of its request's time), for 3-7% more
tokens per chain cycle (E 1.97 against 1.85 on HumanEval, 4.17 against 4.04 on the held-out files); and a recorded
acceptance is of other prompts (tune.json's first position: 0.93 on the held-out files, 0.46 measured on HumanEval),
so a fresh server fed its first rows for a chain that then lost. Chains on an unfed row draft with no drafter entries
for its prompt: lossless, at that lower acceptance (counted apart); so once a chain has measured the drafter on this
traffic, every FEED_EVERY-th admission is fed all the same (every 2 x FEED_EVERY-th for a prompt in the next context
range, and so on), and chains keep measuring a fed row's acceptance on traffic that changes. (Not before: until then
no chain runs but a first one, at once where one is predicted to win, else after seconds of exploring's wait, which a
row fed now would not live to see; on a fresh server with a drafter that accepts nothing, the 16th request's prefill
fed for no chain was 1.8% of the load at 8 rows.)
"""

from __future__ import annotations

import collections
import itertools
import statistics
from collections.abc import Sequence

import numpy as np

from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.profiling.cost_model import expected_tokens
from jaxspec.serving.plan import Counters, Segment

RECENT = 8  # cycle-time measurements kept per (shape, row bucket)
FIRST = 3  # measurements of every candidate at a bucket before the policy chooses there (unless it is losing)
LOSING = 0.5  # a candidate predicted below this fraction of the best one's is not measured FIRST times
DECAY = 0.9  # weight of the acceptance counters before a drafting segment's
EXPLORE_SHARE = 0.02  # time share re-measuring a candidate predicted as fast as the chosen one (less if slower)
FEED = 1.0  # rows are fed the drafter at prefill when some chain is predicted at this fraction of plain's or more
# (1: where a chain is predicted to win; the drafter's prefill is about a quarter of a long prompt's, which a near
# tie does not repay)
FEED_EVERY = 16  # ... and then every FEED_EVERY-th admission all the same (a fed prompt's prefill costs about
# 1.25x an unfed one's on the bundled pair, so this costs ~1.5% of prefill where no chain pays: under the 2% share
# that exploring takes; a drafter of 1 layer beside a 61-layer target makes it nothing), twice as few in each next
# context range of the prompt (a prompt 4x longer costs ~4x as much to feed, and its prefill is more of its request:
# at 1 row, 15% of a 128-token prompt's request of 64 tokens, 54% at 768 tokens and 75% at 1,792; so the forced feeds
# cost about 0.3%, 0.5% and 0.3% of the load in the three ranges, where one in 16 took 1.1% at 768 and 1.2% at 1,792)
PRIOR_ROW_CYCLES = 16  # the weight of a recorded acceptance (`prior`), in row-cycles of the loop's counters
UNKNOWN_ACCEPTANCE = 0.5  # a_j predicted at a draft position nothing has measured or given
CONTEXT_RANGE = 256  # the first context range's longest live length; each next range is 4x longer

Unfed = tuple[Sequence[int], Sequence[int]] | None  # (reached, accepted) per draft position counted by unfed rows


def context_range(length: int) -> int:
    """The context range of a live length: 0 up to CONTEXT_RANGE positions, then one more per 4x longer."""
    span = 0
    while length > CONTEXT_RANGE << 2 * span:
        span += 1
    return span


class DraftPolicy:
    """Chooses each segment's draft shape among `shapes` (compiled candidates) and learns from what segments took;
    `cycles`: the cycles of a segment. `context` (choose, predict, observe): the longest live length of the rows
    generating (0: the first context range)."""

    def __init__(self, shapes: tuple[DraftShape, ...], cycles: int):
        beside_tree = any(s.tree for s in shapes) and sum(not s.plain for s in shapes) > 1
        if not shapes or beside_tree or len(set(shapes)) != len(shapes):
            raise ValueError(
                f"DraftPolicy.shapes: expected distinct shapes (several: chains, or plain decoding and a tree), got "
                f"{shapes}"
            )
        self.shapes, self.cycles = shapes, cycles
        self.depth = max(s.num_steps for s in shapes)
        self.cycle_seconds: dict[tuple[DraftShape, int, int], float] = {}  # (shape, row bucket, range) -> T
        self._recent: dict[tuple[DraftShape, int, int], collections.deque] = {}
        self._timed: collections.Counter[tuple[DraftShape, int]] = collections.Counter()  # (shape, bucket) -> times
        self._cycles: dict[int, dict[tuple[DraftShape, int], float | None]] = {}  # bucket -> `_cycle`s there
        # (fed, context range or None: every range) -> the decayed (reached, accepted) counters of the rows fed the
        # drafter at prefill (fed; with the prior) or not: a chain accepts less on a row not fed
        self._counts: dict[tuple[bool, int | None], tuple[np.ndarray, np.ndarray]] = {}
        self._idle: dict[tuple[DraftShape, int, int], float] = {}  # seconds of a (bucket, range)'s segments since
        self._last: Counters | None = None
        self.predicted: float | None = None  # tokens/s predicted for the last chosen segment (None: not yet timed)
        self.probing = False  # the last chosen segment measures a timed shape's acceptance alone: one cycle will do
        # E per (draft depth, range, fed) and a_j per (range or None, fed) under the counters: the scheduler asks for
        # them every step, and they change only when the counters do (`observe`, `prior`)
        self._expected: dict[tuple[int, int, bool], float] = {}
        self._accepting: dict[tuple[int | None, bool], np.ndarray] = {}
        self._unfed = 0  # admissions not fed the drafter in a row
        self._measured_online = False  # a drafting segment has counted acceptance on this traffic
        self._fed_online = False  # ... on rows fed the drafter at prefill
        self._fed_any = False  # a row has been fed the drafter at prefill
        self._calibrated: dict[tuple[DraftShape, int], float] = {}  # (shape, row bucket) -> T timed at warm-up
        self._recorded = np.full(self.depth, np.nan)  # the recorded a_j (`prior`; NaN: none given there) ...
        self._recorded_weight = 0.0  # ... and its weight in row-cycles, decayed as a fed row's counters are
        self._online: set[tuple[DraftShape, int, int]] = set()  # (shape, row bucket, range) timed by segments

    def prior(self, acceptance) -> None:
        """The drafter's recorded conditional acceptance a_j per draft position (e.g. tune.json's), a fed row's, as a
        prior worth PRIOR_ROW_CYCLES row-cycles, decayed as the fed rows' counters are: the first segments predict
        from it, and online counters outweigh it (its deeper positions scaled as the traffic's a_1 moves from its
        a_1, as every narrower prior is: `_shrunk`)."""
        given = np.clip(np.nan_to_num(np.asarray(acceptance, np.float64)[: self.depth]), 0.0, 1.0)
        self._recorded = np.pad(given, (0, self.depth - len(given)), constant_values=np.nan)
        self._recorded_weight = PRIOR_ROW_CYCLES
        self._forget()

    def since(self, counters: Counters) -> None:
        """Learn only from what the loop counts after `counters` (a fresh policy over a used loop state: the
        warm-up's dummy requests are not traffic)."""
        self._last = counters

    def calibrate(self, shape: DraftShape, rows: int, seconds_per_cycle: float) -> None:
        """A cycle time of `shape` over a bucket of `rows` short rows (the first context range) measured before
        serving (warm-up): the policy trusts it as FIRST online measurements (which then replace it)."""
        if shape not in self.shapes or not seconds_per_cycle > 0:
            raise ValueError(
                f"DraftPolicy.calibrate: a positive time of one of {self.shapes}, got {shape}, {seconds_per_cycle}"
            )
        self._measured((shape, rows, 0), seconds_per_cycle)
        self._calibrated[shape, rows] = seconds_per_cycle

    def acceptance(self, context: int | None = None, fed: bool = True) -> np.ndarray:
        """The decayed a_j per draft position (NaN where never reached) of rows fed the drafter at prefill (`fed`; the
        recorded acceptance is theirs) or not: over every context range, or in the range of `context`. Each narrower
        set of counters is predicted from its own with the wider one's a_j as a prior (`_shrunk`): unfed rows' from
        the fed rows', a range's from its rows' over every range."""
        return self._accepted(None if context is None else context_range(context), fed).copy()

    def _accepted(self, span: int | None, fed: bool) -> np.ndarray:
        """`acceptance` at range `span` (None: every range), kept until the counters change (not to be written)."""
        key = (span, fed)
        if key not in self._accepting:
            if span is not None:
                a = self._shrunk(fed, span, self._accepted(None, fed))
            elif fed:
                a = self._shrunk(True, None, self._recorded, self._recorded_weight)
            else:
                a = self._shrunk(False, None, self._accepted(None, True))
            self._accepting[key] = a
        return self._accepting[key]

    def _shrunk(self, fed: bool, span: int | None, wider: np.ndarray, weight: float = PRIOR_ROW_CYCLES) -> np.ndarray:
        """The a_j of the counters at (`fed`, `span`), with `wider` as a prior worth `weight` row-cycles, its deeper
        positions' scaled by how these counters' a_1 compares with its a_1 (a chain seldom reaches them where a_1 is
        low, so their own counters stay few: the bundled pair's a_j at 768 tokens were 0.37-0.44x its a_j at 128 at
        every position, where an unscaled prior kept a_2..a_4 at the short range's and predicted a losing chain at
        0.9x plain decoding; on an unfed row they were 0.56, 0.40, 0 where fed rows' were 0.73, 0.80, 0.85; on
        HumanEval, tune.json's a_j, recorded on the held-out files, are 0.93, 0.91, 0.95, 0.87, where fed rows
        measured a_1 near 0.7 and a_2 near 0.4, and the unscaled a_3, a_4 kept a losing chain predicted to win over
        three requests at 1 row). `wider` where these counters count nothing."""
        if (fed, span) not in self._counts:
            return wider
        reached, accepted = self._counts[fed, span]
        known = np.isfinite(wider)
        weights, prior = np.where(known, weight, 0.0), np.where(known, wider, 0.0)
        own = _ratio(reached + weights, accepted + weights * prior)
        if prior[0] > 0:  # then own[0] is finite (the prior weighs in)
            prior[1:] = np.minimum(prior[1:] * own[0] / prior[0], 1.0)
            own = _ratio(reached + weights, accepted + weights * prior)
        return own

    def _counted(self, fed: bool, span: int | None) -> tuple[np.ndarray, np.ndarray]:
        return self._counts.get((fed, span), (np.zeros(self.depth), np.zeros(self.depth)))

    def predict(
        self, shape: DraftShape, rows: int, generating: int, context: int = 0, fed: int | None = None
    ) -> float | None:
        """Tokens per second of `shape` over a bucket of `rows` rows with `generating` rows generating, `fed` of them
        fed the drafter at prefill (None: all), the longest `context` positions long (None: not timed at that bucket
        yet)."""
        t = self._cycle(shape, rows, context_range(context))
        if t is None:
            return None
        fed = generating if fed is None else fed
        rows_by_kind = ((fed, True), (generating - fed, False))  # E of a kind no row is of is not worked out
        return sum(n * self._tokens(shape, context, f) for n, f in rows_by_kind if n) / t

    def _tokens(self, shape: DraftShape, context: int, fed: bool) -> float:
        """E: the tokens a cycle of `shape` yields per row (fed or not), `context` positions long."""
        if shape.plain:
            return 1.0
        key = (shape.num_steps, context_range(context), fed)
        if key not in self._expected:  # once per depth and range between observations (the scheduler's per step)
            a = self._accepted(key[1], fed)
            self._expected[key] = expected_tokens(np.where(np.isnan(a), UNKNOWN_ACCEPTANCE, a), shape.num_steps)
        return self._expected[key]

    def _cycle(self, shape: DraftShape, rows: int, span: int) -> float | None:
        """T of `shape` at (`rows`, range `span`), as at the nearest range measured at that bucket (by any shape); a
        shape not measured there: its T at its own nearest range, scaled by the median ratio of the T of the shapes
        measured at both ranges (1 where none was). Kept until a time changes (the scheduler asks every step)."""
        kept = self._cycles.setdefault(rows, {})
        if (shape, span) not in kept:
            kept[shape, span] = self._worked_out_cycle(shape, rows, span)
        return kept[shape, span]

    def _worked_out_cycle(self, shape: DraftShape, rows: int, span: int) -> float | None:
        spans = {q for _, b, q in self.cycle_seconds if b == rows}
        if not spans:
            return None
        span = min(spans, key=lambda q: (abs(q - span), q))
        own = [q for s, b, q in self.cycle_seconds if s == shape and b == rows]
        if (shape, rows, span) in self.cycle_seconds or not own:
            return self.cycle_seconds.get((shape, rows, span))
        near = min(own, key=lambda q: (abs(q - span), q))
        ratios = [
            self.cycle_seconds[s, rows, span] / self.cycle_seconds[s, rows, near]
            for s in self.shapes
            if (s, rows, span) in self.cycle_seconds and (s, rows, near) in self.cycle_seconds
        ]
        t = self.cycle_seconds[shape, rows, near]
        return t * statistics.median(ratios) if ratios else t

    def choose(self, rows: int, generating: int, context: int = 0, fed: int | None = None) -> DraftShape:
        """The draft shape of the next segment over a bucket of `rows` rows, `generating` of them generating and `fed`
        of those fed the drafter at prefill (None: all), the longest `context` positions long."""
        timed = {s: self._timed[s, rows] for s in self.shapes}
        predicted = {s: self.predict(s, rows, generating, context, fed) for s in self.shapes if timed[s]}
        best = max(predicted.values(), default=None)
        close = lambda s: predicted[s] >= LOSING * best
        learning = [
            s
            for s in self.shapes
            if not timed[s] or (timed[s] < FIRST and (s, rows) not in self._calibrated and close(s))
        ]
        if learning:
            shape = min(learning, key=timed.get)  # the first of the fewest timed
        else:
            shape, span = max(self.shapes, key=predicted.get), context_range(context)
            for other in self.shapes:
                segment = self._cycle(other, rows, span) * self.cycles * best / predicted[other]
                if other != shape and self._idle.get((other, rows, span), 0.0) * EXPLORE_SHARE >= segment:
                    shape = other
                    break
        self.probing = timed[shape] > 0 and not self._measured_online and not shape.plain
        self.predicted = predicted.get(shape)
        return shape

    def feeds_drafter(self, context: int = 0, rows: int | None = None, fed: int | None = None) -> bool:
        """Whether a row admitted now, its prompt `context` tokens long, served beside others in a bucket of `rows`
        rows in all (None: at any bucket), `fed` of the others fed the drafter at prefill (None: not said), is fed
        the drafter at prefill, once a chain has measured the drafter on this traffic: where a chain is predicted at
        FEED x plain decoding or more there on a fed row, or where the last FEED_EVERY - 1 admissions (`admitted`)
        were not fed (twice as many in each next context range of the prompt: feeding a longer prompt costs more).
        But until a chain has measured a fed row, one row only (the first rows a fresh server serves are not fed,
        and a chain on them measures a lower acceptance than a fed row's, which would keep every next row unfed;
        where the recorded acceptance a fed row is predicted by is of other prompts, more would pay for it), and
        that one, as every FEED_EVERY-th, only where a chain is predicted over the rows it joins as they are (it
        fed, the others as `fed` says): a row fed to be measured beside unfed rows whose acceptance keeps the
        bucket plain sees no chain (a fresh server's HumanEval load at 8 rows fed one for 1.3-2.0% of its time)."""
        learning = self._measured_online and not self._fed_online
        beside = fed if learning and rows is not None else None
        if self._measured_online and self._unfed >= (FEED_EVERY << context_range(context)) - 1:
            return beside is None or self._drafter_pays(context, rows, beside)
        return not (learning and self._fed_any) and self._drafter_pays(context, rows, beside)

    def admitted(self, fed: bool) -> None:
        """A row was admitted, fed the drafter at prefill or not."""
        self._unfed = 0 if fed else self._unfed + 1
        self._fed_any = self._fed_any or fed

    def _drafter_pays(self, context: int, rows: int | None, beside: int | None = None) -> bool:
        """Some chain predicted at FEED x plain decoding's throughput or more on a fed row, `context` positions long,
        at the bucket of `rows` rows or the nearest one where both were timed (None: at any), with an acceptance
        measured online (else False); True where no bucket has both timed yet. `beside`: the row is served with the
        others there, `beside` of them fed (a segment's E is its rows' mean), not alone."""
        plain = [s for s in self.shapes if s.plain]
        chains = [s for s in self.shapes if not s.plain]
        if not plain or not chains:
            return True
        if not self._measured_online:
            return False
        pays = {}
        for bucket in {bucket for _, bucket, _ in self.cycle_seconds}:
            n = 1 if beside is None else min(rows, bucket)
            f = min(1 + (beside or 0), n)
            base = self.predict(plain[0], bucket, n, context)
            drafted = [self.predict(s, bucket, n, context, f) for s in chains]
            if base is not None and None not in drafted:
                pays[bucket] = max(drafted) >= FEED * base
        if not pays or rows is None:
            return any(pays.values()) or not pays
        above = [b for b in pays if b >= rows]
        return pays[min(above) if above else max(pays)]

    def observe(
        self, segment: Segment, counters: Counters, seconds: float | None, context: int = 0, unfed: Unfed = None
    ) -> None:
        """What a segment of the last plan took: its wall `seconds` (None: it ran prefill chunks too, so its time is
        not its cycles'), the loop's counters after it, its longest generating row's `context` when chosen, and
        `unfed`: the (reached, accepted) per draft position that its rows not fed the drafter at prefill counted
        (their rows' own counters; None: every row was fed)."""
        last = self._last if self._last is not None and self._last.cycles <= counters.cycles else None
        delta = counters.minus(last) if last is not None else counters
        self._last = counters
        if delta.cycles <= 0:
            return
        span = context_range(context)
        if seconds is not None:
            if segment.cycles >= self.cycles:  # a probe's time is mostly what a segment pays once (catch-up, calls)
                self._measured((segment.draft, segment.rows, span), seconds / delta.cycles)
                self._online.add((segment.draft, segment.rows, span))
                self._rescale_calibrated(segment.rows, span)
            for shape in self.shapes:
                idle = (shape, segment.rows, span)
                self._idle[idle] = 0.0 if shape == segment.draft else self._idle.get(idle, 0.0) + seconds
        if not any(delta.reached[: self.depth]):  # a plain segment: nothing to count
            return
        counted = np.asarray([delta.reached, delta.accepted], np.float64)[:, : self.depth]
        apart = np.zeros_like(counted) if unfed is None else np.asarray(unfed, np.float64)[:, : self.depth]
        for fed, (reached, accepted) in ((True, np.maximum(counted - apart, 0.0)), (False, apart)):
            if not reached.any():
                continue
            self._measured_online, self._fed_online = True, self._fed_online or fed
            self._recorded_weight *= DECAY if fed else 1.0
            for key in ((fed, None), (fed, span)):
                before = self._counted(*key)
                self._counts[key] = (DECAY * before[0] + reached, DECAY * before[1] + accepted)
            self._forget()

    def _forget(self) -> None:
        """Drop what was worked out from the acceptance counters (they changed)."""
        self._expected.clear()
        self._accepting.clear()

    def _rescale_calibrated(self, rows: int, span: int) -> None:
        """The shapes at (`rows`, the first range) timed at warm-up only: their warm-up T times the median of how
        much the shapes timed online there moved from theirs (the warm-up's rows are short dummies, the traffic's
        longer, which every shape's cycle pays; what the warm-up measures well is the ratio between shapes: on the
        bundled pair at 8 rows a plain cycle took 3.5 ms at warm-up and 4.4 online, which left a chain timed at
        warm-up alone looking faster than it was)."""
        if span:
            return
        moved = [
            self.cycle_seconds[s, rows, 0] / self._calibrated[s, rows]
            for s in self.shapes
            if (s, rows, 0) in self._online and (s, rows) in self._calibrated
        ]
        if not moved:
            return
        for s in self.shapes:
            if (s, rows) in self._calibrated and (s, rows, 0) not in self._online:
                self.cycle_seconds[s, rows, 0] = self._calibrated[s, rows] * statistics.median(moved)
        self._cycles.pop(rows, None)

    def _measured(self, key: tuple[DraftShape, int, int], seconds_per_cycle: float) -> None:
        recent = self._recent.setdefault(key, collections.deque(maxlen=RECENT))
        if len(recent) < RECENT:  # else the oldest goes: `_timed` counts the measurements kept, over the ranges
            self._timed[key[:2]] += 1
        recent.append(seconds_per_cycle)
        self.cycle_seconds[key] = statistics.median(recent)  # not numpy's: ~20x its time on a few floats
        self._cycles.pop(key[1], None)  # a bucket's T are worked out from its own times only


def _ratio(reached: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """`conditional_acceptance` of counters known to be valid, without its checks (the policy's every step)."""
    return np.where(reached > 0, accepted / np.where(reached > 0, reached, 1), np.nan)


class Scripted:
    """A policy that decides nothing: each segment runs the next of `shapes` (in a cycle), and every admitted row is
    fed the drafter at prefill or none is (`feed`). What tests and benchmarks pin an engine to (e.g. plain decoding
    and no feeding, for what auto costs when it always chooses plain)."""

    predicted, probing = None, False

    def __init__(self, shapes: tuple[DraftShape, ...], feed: bool = True):
        self.shapes, self.feed = itertools.cycle(shapes), feed

    def choose(self, rows: int, generating: int, context: int = 0, fed: int | None = None) -> DraftShape:
        return next(self.shapes)

    def observe(
        self, segment: Segment, counters: Counters, seconds: float | None, context: int = 0, unfed: Unfed = None
    ) -> None:
        pass

    def feeds_drafter(self, context: int = 0, rows: int | None = None, fed: int | None = None) -> bool:
        return self.feed

    def admitted(self, fed: bool) -> None:
        pass


class Calibration:
    """The scheduler's policy during the warm-up's runs of every program: every segment runs `shape` (set by the
    caller), no row is fed the drafter at prefill but those whose prompt is `fed_prompt` tokens long (a chain's
    first segment on a row runs its catch-up, as a fresh adaptive server's first chain does; the warm-up's fed rows
    end at their prompt), and each segment that ran only cycles is timed per cycle by (shape, row bucket)."""

    predicted, probing = None, False

    def __init__(self, shape: DraftShape, fed_prompt: int | None = None):
        self.shape, self.fed_prompt = shape, fed_prompt
        self.times: dict[tuple[DraftShape, int], list[float]] = collections.defaultdict(list)
        self._last: Counters | None = None

    def choose(self, rows: int, generating: int, context: int = 0, fed: int | None = None) -> DraftShape:
        return self.shape

    def feeds_drafter(self, context: int = 0, rows: int | None = None, fed: int | None = None) -> bool:
        return context == self.fed_prompt

    def admitted(self, fed: bool) -> None:
        pass

    def observe(
        self, segment: Segment, counters: Counters, seconds: float | None, context: int = 0, unfed: Unfed = None
    ) -> None:
        cycles = counters.cycles - (self._last.cycles if self._last is not None else counters.cycles)
        self._last = counters
        if seconds is not None and cycles > 0:
            self.times[(segment.draft, segment.rows)].append(seconds / cycles)

    def seconds_per_cycle(self) -> dict[tuple[DraftShape, int], float]:
        """The median cycle time per (shape, row bucket) timed."""
        return {key: float(np.median(times)) for key, times in self.times.items()}


def measured_tokens_per_second(delta: Counters, seconds: float) -> float:
    """Tokens a segment generated (each row-cycle: its accepted drafts + 1) per second of it."""
    return float(np.dot(delta.accept_hist, np.arange(1, len(delta.accept_hist) + 1))) / seconds
