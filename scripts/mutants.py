"""Curated mutants of lightning_nanguard for scripts/mutation.py (see docs/mutation.md).

Each mutant is one realistic, single-behaviour bug: ``find`` must occur exactly once in ``file`` and is
replaced by ``replace``; ``breaks`` says which promise the bug breaks. A mutant whose ``find`` is missing
or ambiguous is reported as stale (code moved or changed): fix its ``file`` or ``find`` by hand, never
delete it silently. ``python scripts/mutation.py --list`` checks every mutant without running tests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    area: str
    id: str
    file: str
    find: str
    replace: str
    breaks: str
    harmless: str = ""  # why a survivor is judged harmless (docs/mutation.md); it still runs


AREAS = ("detection", "ladder", "snapshots", "lr", "clipping", "spikes", "diagnosis", "events", "config",
         "checkpoint", "divergence", "metrics", "sync", "compat", "ranks", "sparse", "amp")

PKG = "lightning_nanguard/"
CALLBACK = PKG + "callback.py"
STEP = PKG + "respond/step.py"
RESPONDER = PKG + "respond/responder.py"  # was incidents.py
INCIDENT = PKG + "respond/incident.py"  # the incident builders and kind_of (issue 25; were Responder methods)
FIT_END = PKG + "respond/fit_end.py"  # the end of fit (issue 25; was in callback.py and responder.py)
PARTS = PKG + "respond/parts.py"  # the parts bundle (issue 25; the parts were built in callback.py)
ENDINGS = PKG + "respond/endings.py"  # give-up and hardware texts (issue 25; were in responder.py)
CONFIG = PKG + "config.py"
EVENTS = PKG + "core/events.py"  # was report/events.py: NaNEvent and the kind table
CAUSE_TABLE = PKG + "core/causes.py"  # the cause table (was diagnose/suggestions.py)
EVIDENCE = PKG + "detect/evidence.py"
KERNELS = PKG + "detect/kernels.py"  # detect/flags.py was split into kernels, vector and verdict
VECTOR = PKG + "detect/vector.py"
VERDICT = PKG + "detect/verdict.py"
WEIGHTS = PKG + "detect/weights.py"  # was detect/state.py
SPIKES = PKG + "detect/spikes.py"
RANKS = PKG + "detect/ranks.py"  # detect/sync.py was split into ranks, replicas, placement, read_mode
READ_MODE = PKG + "detect/read_mode.py"
ACCOUNT = PKG + "respond/account.py"  # share_incident, was in detect/sync.py
AMP = PKG + "detect/amp.py"
LADDER = PKG + "recover/ladder.py"
RECOVERY = PKG + "recover/recovery.py"
LR = PKG + "recover/lr.py"  # an earlier recover/actions.py was split into lr and undo
ACTIONS = PKG + "recover/actions.py"  # each action a class that carries itself out (stop and raise among them)
UNDO = PKG + "recover/undo.py"
SNAPSHOTS = PKG + "store/snapshots.py"
WRITER = PKG + "store/writer.py"
CLIPPING = PKG + "recover/clipping.py"
CKPT = PKG + "recover/checkpoint.py"
RULES = PKG + "diagnose/rules.py"  # was diagnose/causes.py
DIAGNOSER = PKG + "diagnose/diagnoser.py"
FINAL_WEIGHTS = PKG + "diagnose/final_weights.py"  # the end-of-fit rerun (issue 25; was in responder.py)
SINKS = PKG + "report/sinks.py"
RECORDER = PKG + "report/recorder.py"
PROGRESS = PKG + "report/progress.py"
CONSOLE = PKG + "core/console.py"
METRICS = PKG + "recover/metrics.py"
LAYOUTS = PKG + "core/layouts.py"
REPLAY = PKG + "diagnose/replay.py"
FLOAT64 = PKG + "diagnose/float64.py"  # the float64 twin, was in diagnose/replay.py
PROBES = PKG + "diagnose/probes.py"  # was diagnose/recorders.py
RERUN = PKG + "diagnose/rerun.py"  # what every replay is made of (Rewritten: a batch the step wrote into)
LOCKSTEP = PKG + "diagnose/lockstep.py"  # the sharded replay (issue 35)
LIGHTNING = PKG + "lightning.py"
USAGE = PKG + "usage_errors.py"
DIVERGENCE = PKG + "detect/divergence.py"
FIND = PKG + "detect/find.py"
DYNAMICS = PKG + "diagnose/dynamics.py"
CLI = PKG + "report/cli.py"
STATE_SCHEMA = PKG + "state_schema.py"
VERIFY = PKG + "store/verify.py"  # the seal and the read-side checks (issue 34)
SHARDED = PKG + "store/sharded.py"
FLOW = PKG + "detect/flow.py"  # the gradient-flow window (issue 37)
CULPRIT = PKG + "diagnose/culprit.py"
PICTURE_SINK = PKG + "report/picture_sink.py"

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------------------------------ detection
    Mutant("detection", "det-loss-key-ignored", EVIDENCE,
           "if not self.check.loss:", "if False:",
           "check.loss: false is ignored (the loss is still checked)"),
    Mutant("detection", "det-loss-inf-missed", EVIDENCE,
           "loss_bad = None if self._loss_sum is None else ~torch.isfinite(self._loss_sum)",
           "loss_bad = None if self._loss_sum is None else torch.isnan(self._loss_sum)",
           "the step's loss flag tests isnan only: an Inf loss is not flagged (the flag is taken from the loss "
           "sum in StepEvidence.vector since issue 14; detect/flags.py's nonfinite_flag, where this mutant "
           "lived, no longer checks the loss)"),
    Mutant("detection", "det-loss-last-microbatch", EVIDENCE,
           "self._loss_sum = value if self._loss_sum is None else self._loss_sum + value",
           "self._loss_sum = value",
           "with gradient accumulation only the last micro-batch's loss counts "
           "(a NaN loss in an earlier one is missed)"),
    Mutant("detection", "det-gradients-key-ignored", STEP,
           "grads_bad = cfg.check.gradients and flags.grads_bad", "grads_bad = flags.grads_bad",
           "check.gradients: false is ignored (a non-finite gradient norm is still an incident)"),
    Mutant("detection", "det-grad-inf-missed", VECTOR,
           "return not math.isfinite(self[norm]) or",
           "return math.isnan(self[norm]) or",
           "an Inf gradient norm is not an incident (isnan instead of isfinite)"),
    Mutant("detection", "det-inputs-always-ignored", EVIDENCE,
           'if self.check.inputs == "always":', "if False:",
           "check.inputs: always does not check the batch every step"),
    Mutant("detection", "det-params-after-healthy-step", STEP,
           "p.recovery.healthy_step()\n"
           "        p.evidence.after_step(self.responder.fit.module)",
           "p.recovery.healthy_step()",
           "parameters written non-finite by a healthy step are never flagged"),
    Mutant("detection", "det-params-at-train-end", FIT_END,
           "elif bad:\n"
           '            self.responder.bad_weights("train_end")',
           "elif False:\n"
           '            self.responder.bad_weights("train_end")',
           "a parameter fault at the last step is not caught at train end (non-finite weights left)"),
    Mutant("detection", "det-params-before-validation", CALLBACK,
           "if self._recovery.stopped:\n            return\n        bad = self._evidence.state_bad(consume=True)",
           "if not self._recovery.stopped:\n            return\n        bad = self._evidence.state_bad(consume=True)",
           "validation runs on weights poisoned by the last training step (inverted condition)"),
    Mutant("detection", "det-statecheck-exempt-ignored", WEIGHTS,
           "named = [(n, t) for n, t in self.named(module) if",
           "named = [(n, t) for n, t in list(module.named_parameters()) + list(module.named_buffers()) if",
           "the weight check before snapshots and validation ignores the exempt constant buffers (a -inf causal mask)"),
    # new with the restructure: the StepFlags vector, its reduce over ranks, the event kind, the scaler
    Mutant("detection", "det-flags-field-order", VECTOR,
           "self.flags = slice(1, 1 + len(flags))",
           "self.flags = slice(1, len(flags))",
           "the evidence vector's layout (derived from the schema's declarations since issue 18; was a "
           "hand-ordered StepFlags, where a field added after grad_scale left a flag out of the DDP reduce) is "
           "off by one: the last flag (loss_bad) falls out of the flag slice, so a non-finite loss is no "
           "rank-local evidence, is not in the device skip flag and is never kind loss"),
    Mutant("detection", "det-ddp-loss-summed", RANKS,
           "out[i] = out[i] / self.world_size",
           "pass",
           "under DDP the step's loss is the sum over ranks, not the mean (spike statistics, event loss)"),
    Mutant("detection", "det-kind-loss-as-gradient", VECTOR,
           'Field("loss_bad", "sum", kind="loss",',
           'Field("loss_bad", "sum", kind="gradient",',
           "a non-finite loss is recorded as a gradient incident"),
    Mutant("detection", "det-overflow-never-incident", VERDICT,
           "if scaled and not overflow_persists:",
           "if scaled:",
           "16-mixed: GradScaler overflows never become an incident (amp_overflow_patience/amp_min_scale ignored)"),
    Mutant("detection", "det-overflow-patience-off-by-one", AMP,
           "return self.overflows >= self.patience or", "return self.overflows > self.patience or",
           "check.amp_overflow_patience: one routine overflow more than configured before an incident"),

    # --------------------------------------------------------------------------------------------- ladder
    Mutant("ladder", "lad-max-skips-off-by-one", LADDER,
           "or self.incidents_in_a_row > self.cfg.max_skips", "or self.incidents_in_a_row >= self.cfg.max_skips",
           "rolls back after max_skips consecutive incidents instead of more than max_skips"),
    Mutant("ladder", "lad-max-rollbacks-off-by-one", LADDER,
           "if self.unconfirmed_rollbacks >= self.cfg.max_rollbacks or",
           "if self.unconfirmed_rollbacks > self.cfg.max_rollbacks or",
           "one failed rollback more than recovery.max_rollbacks before giving up"),
    Mutant("ladder", "lad-further-back-for-parameters", LADDER,
           "plan.go_further_back = self.unconfirmed_rollbacks > 0 and not weights",
           "plan.go_further_back = self.unconfirmed_rollbacks > 0",
           "a one-off bad parameter after a failed rollback discards a good snapshot (goes further back)"),
    Mutant("ladder", "lad-skip-batches-ignored", LADDER,
           "plan.skip_batches = self.cfg.skip_batches\n        plan.reasons.append(\"parameters are non-finite\"",
           "plan.skip_batches = 0\n        plan.reasons.append(\"parameters are non-finite\"",
           "recovery.skip_batches is ignored after a rollback"),
    Mutant("ladder", "lad-window-boundary", LADDER,
           "while self._recent and self._recent[0] <= step - self.cfg.incident_window:",
           "while self._recent and self._recent[0] < step - self.cfg.incident_window:",
           "an incident exactly incident_window steps old still counts towards reduce_lr_after"),
    Mutant("ladder", "lad-reduce-lr-on-rollback-ignored", LADDER,
           " and self.cfg.reduce_lr_on_rollback", "",
           "recovery.reduce_lr_on_rollback: false still cuts the LR after a forced rollback"),
    Mutant("ladder", "lad-cut-on-every-exploding", LADDER,
           'by_cause = policy.lr_cut in ("at_once", "sized") and (self.incidents_in_a_row == 1 or what.runaway)',
           'by_cause = policy.lr_cut in ("at_once", "sized")',
           "the LR is cut on every incident diagnosed exploding_gradient (or learning_rate), not the first of a run"),
    Mutant("ladder", "lad-confirm-after-ignored", RECOVERY,
           "every = min(every, self.cfg.confirm_after)", "every = self.cfg.snapshot_every",
           "recovery.confirm_after is ignored: a rollback is confirmed only at the next snapshot_every"),
    Mutant("ladder", "lad-give-up-no-stop", ACTIONS,
           "trainer.should_stop = True\n"
           '        say(trainer, "[nanguard] " + message)',
           'say(trainer, "[nanguard] " + message)',
           "on_give_up: stop does not stop the Trainer"),
    Mutant("ladder", "lad-give-up-raise-ignored", ACTIONS,
           "raise NaNGuardError(message)",
           "Stop().end(trainer, message)",
           "on_give_up: raise stops quietly instead of raising NaNGuardError (giving up, non-finite weights at fit "
           "start and after a stop share the Raise action's end)"),
    Mutant("ladder", "lad-give-up-restores-nothing", ACTIONS,
           "restored = recovery.rollback(hands.trainer, hands.module, hands.scaler_overflows) if recovery.store \\",
           "restored = recovery.rollback(hands.trainer, hands.module, hands.scaler_overflows) if False \\",
           "giving up leaves the last (bad) weights instead of restoring the last known-good state"),
    Mutant("ladder", "lad-param-without-snapshot-continues", LADDER,
           "or not can_roll_back and weights:",
           "or False and weights:",
           "non-finite parameters with no snapshot (snapshot: off) do not give up: training goes on with NaN"),

    # ------------------------------------------------------------------------------------------ snapshots
    Mutant("snapshots", "snap-rollback-to-oldest", SNAPSHOTS,
           "kept = [s for s in reversed(self.ring) if not s.failed",
           "kept = [s for s in self.ring if not s.failed",
           "a rollback loads the oldest snapshot instead of the newest"),
    Mutant("snapshots", "snap-optimizer-not-restored", SNAPSHOTS,
           "opt.load_state_dict(opt_state)",
           "pass",
           "a rollback restores weights but keeps the optimizer state (Adam moments, step)"),
    Mutant("snapshots", "snap-scheduler-not-restored", SNAPSHOTS,
           "sched_cfg.scheduler.load_state_dict(sched_state)",
           "pass",
           "a rollback does not restore the LR schedulers"),
    Mutant("snapshots", "snap-lr-cuts-lost", RECOVERY,
           "if snap_scale != self.lr_scale:", "if False:",
           "LR cuts made after the snapshot are lost on rollback (lr_scale says one thing, the LR another)"),
    Mutant("snapshots", "snap-stats-not-restored", RECOVERY,
           "if name in snap.meta:", "if False:",
           "a rollback keeps the norm/loss statistics polluted by the divergence"),
    Mutant("snapshots", "snap-restore-aliases", SNAPSHOTS,
           "tensors = [t.clone() for t in snap.tensors] if copy else list(snap.tensors)",
           "tensors = list(snap.tensors)",
           "restoring aliases the snapshot's tensors: training after a rollback overwrites the snapshot"),
    Mutant("snapshots", "snap-further-back-not-dropped", ACTIONS,
           "if self.further:\n            store.drop_newest()",
           "if False:\n            store.drop_newest()",
           "a rollback that did not help rolls back to the same snapshot again"),
    Mutant("snapshots", "snap-no-initial-snapshot", CALLBACK,
           "self._flow.snapshot()\n\n    def on_train_end", "pass\n\n    def on_train_end",
           "no snapshot at train start: nothing to roll back to before the first snapshot_every"),
    Mutant("snapshots", "snap-poisoned-state-snapshotted", STEP,
           "if weights_bad:  # never snapshot poisoned state",
           "if False:  # never snapshot poisoned state",
           "a snapshot is taken of non-finite weights"),
    Mutant("snapshots", "snap-optimizer-state-unchecked", STEP,
           "own_state_bad = optimizer_state_nonfinite(trainer.optimizers) if checked else False",
           "own_state_bad = False",
           "a snapshot keeps an inf Adam moment (frozen weights) instead of rolling back"),
    Mutant("snapshots", "snap-bn-not-undone-on-incident", STEP,
           "        if record.update is UpdateStage.ON_HOST:  # its bad forward's buffer writes",
           "        if False:  # its bad forward's buffer writes",
           "a skipped step keeps the BatchNorm statistics its bad forward pass wrote"),
    Mutant("snapshots", "snap-does-not-confirm", RECOVERY,
           "self._ladder.snapshot_taken()",
           "pass",
           "a new snapshot does not confirm the last rollback: isolated incidents far apart add up to give up"),
    # new: the ring's size, and the snapshot gate on a diverging gradient norm
    Mutant("snapshots", "snap-keep-off-by-one", SNAPSHOTS,
           "        self._trim(self.keep - 1)  # evict first", "        self._trim(self.keep)  # evict first",
           "recovery.keep_snapshots + 1 snapshots are kept (memory/disk bound exceeded)"),
    Mutant("snapshots", "snap-while-diverging", STEP,
           "if p.recovery.snapshot_due() and not p.clipper.diverging() and",
           "if p.recovery.snapshot_due() and",
           "a snapshot is taken while the gradient norm runs away (a rollback target that cannot help)"),

    # ------------------------------------------------------------------------------------------------ lr
    Mutant("lr", "lr-group-keys-lr-only", LR,
           '_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "base_lr")',
           '_GROUP_LR_KEYS = ("lr",)',
           "scale_lr leaves initial_lr/max_lr/min_lr: OneCycleLR/CyclicLR undo the cut"),
    Mutant("lr", "lr-sched-base-lrs", LR,
           '_SCHED_LR_ATTRS = ("base_lrs", "_last_lr",',
           '_SCHED_LR_ATTRS = ("_last_lr",',
           "scheduler base_lrs not scaled: LambdaLR/StepLR/cosine undo the cut at the next step"),
    Mutant("lr", "lr-nested-schedulers", LR,
           'for inner in getattr(scheduler, "_schedulers", None) or []:',
           "for inner in []:",
           "the schedulers inside SequentialLR/ChainedScheduler are not scaled"),
    Mutant("lr", "lr-min-scale-floor-ignored", RECOVERY,
           "new_scale = max(self.lr_scale * factor, self.cfg.min_lr_scale)",
           "new_scale = self.lr_scale * factor",
           "recovery.min_lr_scale floor is ignored"),
    Mutant("lr", "lr-factor-hardcoded", RECOVERY,
           "factor = self.cfg.lr_factor if factor is None else factor",
           "factor = 0.5 if factor is None else factor",
           "recovery.lr_factor is ignored (always 0.5)"),
    Mutant("lr", "lr-cut-at-floor-counted", RECOVERY,
           "cut = new_scale < self.lr_scale", "cut = new_scale <= self.lr_scale",
           "at the min_lr_scale floor a no-op 'cut' is still recorded as reduce_lr and counted"),
    Mutant("lr", "lr-absolute-factor", RECOVERY,
           "new_scale / self.lr_scale)", "new_scale)",
           "the optimizer LR is multiplied by the cumulative scale on every cut (0.5, then 0.125, ...)"),
    Mutant("lr", "lr-sized-cut-repeated-on-rollback", LADDER,
           "if by_rollback and self.sized_cut and not (by_cause or by_runaway or by_count):",
           "if False:",
           "the rollback after a cut to the diagnosis' safe LR cuts again (a NaN-path rescue ends 10x too slow)"),
    Mutant("lr", "lr-onset-gradient-on-start-weights", RULES,
           "reference[0] < step and _grown(ctx, reference[1]):",
           "reference[0] < step and False:",
           "after a long growth the onset's 1e18 gradient is measured against the fit-start weights: LR to the floor"),
    Mutant("lr", "lr-edge-from-growth-before-the-cut", RULES,
           "growth=dynamics.growth_rate(_norms(ctx, since=ctx.history.lr_cut_step)),",
           "growth=dynamics.growth_rate(_norms(ctx)),",
           "the edge of stability after an LR cut is estimated from the growth measured at the LR before it"),
    Mutant("lr", "lr-history-steps-shifted", RULES,
           "end = past.norm_history_end if past.norm_history_end is not None else ctx.event.step - 1",
           "end = ctx.event.step - 1",
           "skipped incident steps shift the gradient-norm history: a norm is taken for another step's"),

    # ------------------------------------------------------------------------------------------ clipping
    Mutant("clipping", "clip-max-norm-ignored", CLIPPING,
           "limits = [x for x in (self.cfg.max_norm, extra) if x is not None]",
           "limits = [x for x in (extra,) if x is not None]",
           "clip.max_norm is ignored altogether"),
    Mutant("clipping", "clip-lagged-compared-in-float32", CLIPPING,
           '    above = (norm if norm.device.type == "mps" else norm.double()) > limit',
           "    above = norm > limit",
           "docs/performance.md, check.sync: lagged compares on the device with the same limit as eager; here in "
           "float32, so a norm within a float32 rounding of the limit (1.0 against 1 - 2**-30) is clipped by eager "
           "and not by lagged"),
    Mutant("clipping", "clip-lagged-host-count-at-limit", CLIPPING,
           "        if limit is not None and norm_value > limit:",
           "        if limit is not None and norm_value >= limit:",
           "docs/performance.md, check.sync: a lagged step's clip is counted on the host as eager decides it; here a "
           "norm exactly at the limit counts as clipped (clipped_steps differs from eager's, the weights do not)"),
    Mutant("clipping", "clip-larger-limit-wins", CLIPPING,
           "return min(limits) if limits else None", "return max(limits) if limits else None",
           "with max_norm and adaptive clipping both on, the larger limit wins"),
    Mutant("clipping", "clip-grads-not-params", CLIPPING,
           "torch.nn.utils.clip_grads_with_norm_(params, limit, norm)",
           "torch.nn.utils.clip_grads_with_norm_([p.grad for p in params if p.grad is not None], limit, norm)",
           "clipping is given bare grad tensors and silently does nothing"),
    Mutant("clipping", "clip-agc-ignored", CLIPPING,
           "if self.cfg.agc_clip_factor is not None:\n"
           "            adaptive_grad_clip_(params, self.cfg.agc_clip_factor)\n"
           "        if norm is not None:",
           "if False:\n            adaptive_grad_clip_(params, self.cfg.agc_clip_factor)\n"
           "        if norm is not None:",
           "clip.agc_clip_factor is ignored"),
    Mutant("clipping", "clip-norm-type-ignored", STEP,
           "Ranks.for_trainer(trainer, p.config.clip.norm_type, check.replicas,",
           "Ranks.for_trainer(trainer, 2.0, check.replicas,",
           "clip.norm_type is ignored (always the 2-norm)"),
    Mutant("clipping", "clip-zclip-z-ignored", CLIPPING,
           "self.zclip = ZClip(cfg.z_threshold, cfg.ema_alpha, cfg.warmup_steps)",
           "self.zclip = ZClip(2.5, cfg.ema_alpha, cfg.warmup_steps)",
           "clip.z_threshold is ignored"),
    Mutant("clipping", "clip-zclip-warmup-ignored", CLIPPING,
           "self.zclip = ZClip(cfg.z_threshold, cfg.ema_alpha, cfg.warmup_steps)",
           "self.zclip = ZClip(cfg.z_threshold, cfg.ema_alpha)",
           "clip.warmup_steps is ignored (always 25)"),
    Mutant("clipping", "clip-zclip-alpha-ignored", CLIPPING,
           "self.zclip = ZClip(cfg.z_threshold, cfg.ema_alpha, cfg.warmup_steps)",
           "self.zclip = ZClip(cfg.z_threshold, 0.97, cfg.warmup_steps)",
           "clip.ema_alpha is ignored (always 0.97)"),
    Mutant("clipping", "clip-adaptive-always-ignored", CLIPPING,
           'self.armed = cfg.adaptive == "always"',
           "self.armed = False",
           "clip.adaptive: always waits for a first incident (whether adaptive clipping is armed is the "
           "clipper's since issue 18, was the ladder's adaptive_clip)"),
    Mutant("clipping", "clip-streak-no-rollback", INCIDENT,
           "back: tuple[Action, ...] = (RollBack(),) if can_roll_back else ()",
           "back: tuple[Action, ...] = ()",
           "persistent adaptive clipping cuts the LR but does not roll back the drifted weights"),

    # ------------------------------------------------------------------------------- stalls (issue 41 item 2)
    Mutant("divergence", "stall-ratio-ignored", STEP,
           "            if ratio is None or ratio < watch.ratio or", "            if ratio is None or ratio < 1e9 or",
           "docs/recovery.md: a lower-LR probe that learns check.stall_gain_ratio x more is a stall; here never"),
    Mutant("divergence", "stall-probe-shares-optimizer-state", PKG + "diagnose/lr_probe.py",
           "    twin.load_state_dict(copy.deepcopy(optimizer.state_dict()))",
           "    twin.load_state_dict(optimizer.state_dict())",
           "the stall probe steps the run's own Adam moments in place: a healthy run is no longer bitwise"),
    Mutant("divergence", "stall-trigger-blind", STEP,
           "            p.stall.observe(record.step, loss)  # host floats only",
           "            p.stall.observe(record.step, None)  # host floats only",
           "the stall trigger never sees a loss: the probe is never armed"),

    # -------------------------------------------------------------------------------------------- spikes
    Mutant("spikes", "spike-skipped-widens-the-test", SPIKES,
           "            if self.hold:  # its update never lands",
           "            if False:  # its update never lands",
           "docs/recovery.md, loss spikes (issue 41): a skipped spike leaves the spike test's statistics as they were, "
           "so every batch of a corrupt stretch is caught; here its capped loss widens the spread threefold and the "
           "later corrupt batches get through"),
    Mutant("spikes", "spike-moved-loss-held-for-good", SPIKES,
           "                if len(self._starts) < SHIFT_SPIKES or",
           "                if True or",
           "docs/recovery.md, loss spikes: skipped spikes that keep coming apart are the loss moving, and the last "
           "is learned; here every batch of a harder source stays a skipped spike and is never trained on"),
    Mutant("spikes", "spike-moved-loss-after-a-stretch", SPIKES,
           "                if self.held == 1:\n                    self._starts.append(self.tests)",
           "                if True:\n                    self._starts.append(self.tests)",
           "docs/recovery.md, loss spikes: a corrupt stretch in a row is one spike start; here its third batch "
           "counts as the loss moving and the rest of the stretch trains"),
    Mutant("diagnosis", "samples-rerun-at-the-reading-step", PKG + "diagnose/samples.py",
           "at_step(trainer, step), ", "",
           "docs/recovery.md: a bad batch's samples are rerun at the spike's own step; here a step judged late reruns "
           "the next step's batch where training_step reads global_step"),
    Mutant("spikes", "spike-bad-batch-counts-towards-lr-cut", STEP,
           'repeated=cause != "input" and detector.repeated(',
           "repeated=detector.repeated(",
           "docs/recovery.md, loss spikes (issue 41): a bad batch's spike (cause input) never counts towards the LR "
           "cut of repeated spikes; here five corrupt batches in a row cut the LR at the third"),
    Mutant("spikes", "spike-after-healthy-not-input", RULES,
           "    if after_healthy:\n",
           "    if False:\n",
           "docs/recovery.md, loss spikes (issue 41): a spike on weights whose loss was healthy a step before is cause "
           "input (the batch); here it stays unknown and counts towards the LR cut"),
    Mutant("spikes", "spike-loss-not-back-never-rolls-back", STEP,
           "p.losses.detector.held >= SPIKE_PATIENCE:",
           "p.losses.detector.held >= 100 * SPIKE_PATIENCE:",
           "docs/recovery.md, loss spikes (issue 41): SPIKE_PATIENCE skipped spikes in a row are a divergence that "
           "rolls back to before the first; here the steps are skipped for ever"),
    Mutant("spikes", "spike-default-action-warn", CONFIG,
           '"skip_step", "what to do when the loss jumps',
           '"warn", "what to do when the loss jumps',
           "docs/recovery.md, loss spikes (issue 41): check.spike_action defaults to skip_step (chosen on the rescue "
           "benchmark); here a spike's update lands by default"),
    Mutant("spikes", "spike-two-sided", SPIKES,
           "return z if z > self.z_threshold else None", "return z if abs(z) > self.z_threshold else None",
           "a sudden drop of the loss counts as a spike"),
    Mutant("spikes", "spike-z-ignored", PARTS,
           "LossWatch(cfg.check.spike_action, cfg.check.spike_z, cfg.check.spike_warmup)",
           "LossWatch(cfg.check.spike_action, 6.0, cfg.check.spike_warmup)",
           "check.spike_z is ignored"),
    Mutant("spikes", "spike-warmup-ignored", PARTS,
           "LossWatch(cfg.check.spike_action, cfg.check.spike_z, cfg.check.spike_warmup)",
           "LossWatch(cfg.check.spike_action, cfg.check.spike_z, 50)",
           "check.spike_warmup is ignored (always 50)"),
    Mutant("spikes", "spike-skip-step-not-skipped", RESPONDER,
           "done = incident.skip.carry_out(hands, done)",
           "done = (done.then(incident.skip) if incident.skip.mirrored and incident.skip.undo_buffers and "
           "record.update.value == \"on_host\" and p.recovery.count_skip() is None else "
           "incident.skip.carry_out(hands, done))",
           "check.spike_action: skip_step records (and counts) a skip but the optimizer still steps (eager: the "
           "host skip is Recovery.keep_from_landing since issue 25, called from Responder._skip_and_clip; a spike "
           "to skip is the only incident whose SkipStep is mirrored and undoes buffers)"),
    Mutant("spikes", "spike-skip-step-bn-kept", INCIDENT,
           'skip=SkipStep(mirrored=True, undo_buffers=True) if action == SkipStep.name else None',
           'skip=SkipStep(mirrored=True, undo_buffers=False) if action == SkipStep.name else None',
           "a spike skipped with skip_step keeps the BatchNorm statistics of the spiking batch"),
    Mutant("spikes", "spike-action-off-ignored", SPIKES,
           "if loss is None or not self.enabled:", "if loss is None:",
           "check.spike_action: off still records spike events"),
    Mutant("spikes", "spike-repeated-no-cut", INCIDENT,
           'if action == CutLr.name or repeated:',
           'if action == CutLr.name:',
           "repeated spikes within incident_window no longer cut the LR"),

    # ----------------------------------------------------------------------------------------- diagnosis
    Mutant("diagnosis", "diag-optimizer-always", RULES,
           'cause = "optimizer" if evidence.grads_were_finite else "unknown"',
           'cause = "optimizer"',
           "non-finite parameters after non-finite gradients are blamed on the optimizer"),
    Mutant("diagnosis", "diag-overflow-precision-swapped", RULES,
           'return "overflow" if abs_max > limit else "precision"',
           'return "precision" if abs_max > limit else "overflow"',
           "overflow and precision causes are swapped"),
    Mutant("diagnosis", "diag-backward-precision-dropped", RULES,
           'if f64 is not None and f64.get("grads_finite"):\n'
           '        return "precision"',
           'if False:\n'
           '        return "precision"',
           "a backward NaN that is finite in float64 is called backward_op instead of precision"),
    Mutant("diagnosis", "diag-history-override-ignores-features", RULES,
           'data_explained = found in ("overflow", "precision") and bool(diagnosis.extreme_features)',
           "data_explained = False",
           "an overflow from badly scaled input features is blamed on exploding gradients"),
    Mutant("diagnosis", "diag-input-kind-not-set", RESPONDER,
           "kind_of(incident.event.kind, weights, {n for n, _ in pl_module.named_buffers()}, inputs)",
           "kind_of(incident.event.kind, weights, {n for n, _ in pl_module.named_buffers()})",
           "a NaN input is reported as a loss incident (and climbs the ladder like one); the input findings are "
           "still reported (since issue 25 the kind is decided once, incident.kind_of, from Responder._look)"),
    Mutant("diagnosis", "diag-inputs-off-ignored", STEP,
           'check_parameters=cfg.check.parameters, check_inputs=cfg.check.inputs != "off",',
           "check_parameters=cfg.check.parameters, check_inputs=True,",
           "check.inputs: off still inspects the batch on an incident"),
    Mutant("diagnosis", "diag-anomaly-off-still-replays", DIAGNOSER,
           'ctx.replay = (self.cfg.mode != "off" and self.counters["replays"] < self.cfg.max_replays',
           'ctx.replay = (self.counters["replays"] < self.cfg.max_replays',
           "anomaly.mode: off still replays the bad batch"),
    Mutant("diagnosis", "diag-manual-opt-replayed", DIAGNOSER,
           'and getattr(ctx.pl_module, "automatic_optimization", True))', ")",
           "a manual-optimization training_step is replayed (the replay steps its optimizers: it trains)"),
    Mutant("diagnosis", "diag-float64-key-ignored", DIAGNOSER,
           "float64_check=self.cfg.float64_check", "float64_check=True",
           "anomaly.float64_check: false still reruns the replay in float64"),
    Mutant("diagnosis", "diag-in-place-op-judged-after-it-wrote", PROBES,
           "            before = (args[0].detach().clone(), *args[1:])  # an in-place op: its input as it was",
           "            pass",
           "docs/diagnosis.md, the replay: an in-place op (h /= h.norm() on a zero row, x.log_() on a negative) is "
           "judged on its input before it wrote it; here on what it wrote, so the NaN looks passed on and no op is "
           "named (cause unknown instead of domain)"),
    Mutant("diagnosis", "diag-diverging-not-passed", RECOVERY,
           "can_roll_back=self.can_roll_back, cause=cause,",
           "can_roll_back=self.can_roll_back, cause=None,",
           "the incident's diagnosed cause is not passed to the ladder: an exploding_gradient or learning_rate "
           "diagnosis no longer cuts the LR on the first incident, and actions stop following the cause (since "
           "issue 18 every event reaches the ladder through Recovery.plan)"),
    Mutant("diagnosis", "diag-initialization-unchecked", CALLBACK,
           'findings = self._evidence.weights.find(pl_module)\n'
           "            if findings:",
           'findings = []\n'
           "            if findings:",
           "non-finite parameters before training are not reported as an initialization incident"),

    # -------------------------------------------------------------------------------------------- events
    Mutant("events", "ev-no-fsync", SINKS,
           "os.fsync(fd)\n            except OSError:", "pass\n            except OSError:",
           "events.jsonl lines are not fsynced (lost on power failure)"),
    Mutant("events", "ev-torn-line-kept", SINKS,
           "os.ftruncate(fd, start)  # never leave half a line", "pass  # never leave half a line",
           "an append the disk refused halfway leaves half a line in events.jsonl (the next line runs into it); "
           "re-ported from ev-no-flush: the sink writes with os.write, no buffer is left to flush"),
    Mutant("events", "ev-events-file-key-ignored", RECORDER,
           "if cfg.events_file:",
           "if True:",
           "logging.events_file: false still writes events.jsonl"),
    Mutant("events", "ev-tensorboard-key-ignored", RECORDER,
           "if cfg.loggers and trainer.loggers:",
           "if trainer.loggers:",
           "logging.loggers (was logging.tensorboard): false still writes nanguard/ scalars and text"),
    Mutant("events", "ev-reports-key-ignored", RECORDER,
           "if cfg.reports:",
           "if True:",
           "logging.reports: false still writes incident report files"),
    Mutant("events", "ev-verbose-key-ignored", RECORDER,
           "if cfg.verbose:",
           "if True:",
           "logging.verbose: false still prints one line per incident"),
    Mutant("events", "ev-progress-bar-key-ignored", CALLBACK,
           "if self._flow.end() and self.config.logging.progress_bar:",
           "if self._flow.end():",
           "logging.progress_bar: false still logs the status to the progress bar"),
    Mutant("events", "ev-no-scalars-at-incident", SINKS,
           "self.scalars(scalars, step)",
           "pass",
           "nanguard/ scalars are not written at the incident's step"),
    Mutant("events", "ev-event-index-stuck", RECORDER,
           "self._index += 1", "pass",
           "events are not numbered: every incident report overwrites incident-0000-*"),
    Mutant("events", "ev-nonfinite-json", EVENTS,
           "return obj if math.isfinite(obj) else repr(obj)", "return obj",
           "an event holding a NaN detail cannot be written (json allow_nan=False raises)"),
    Mutant("events", "ev-out-dir-ignores-logger", RECORDER,
           "Path(trainer.log_dir or trainer.default_root_dir)", "Path(trainer.default_root_dir)",
           "events.jsonl is written under default_root_dir instead of the logger's log_dir"),
    # new: every logger, a named guard's own folder and tags, the bar's integer count, the vocabularies
    Mutant("events", "ev-first-logger-only", RECORDER,
           "sinks.append(LoggerSink(trainer.loggers, prefix=",
           "sinks.append(LoggerSink([trainer.logger], prefix=",
           "only the Trainer's first logger receives the nanguard/ scalars (trainer.logger, not .loggers)"),
    Mutant("events", "ev-metrics-logger-skipped", SINKS,
           "logger.log_metrics(dict(values), step=step)", "pass",
           "a logger without add_scalar/add_text (CSVLogger) receives no nanguard/ scalars"),
    Mutant("events", "ev-name-folder-shared", RECORDER,
           "if self.name:\n            self.out_dir = self.out_dir / self.name",
           "if False:\n            self.out_dir = self.out_dir / self.name",
           "two named guards write the same <log_dir>/nanguard/events.jsonl and report files"),
    Mutant("events", "ev-name-tags-shared", RECORDER,
           'prefix=f"nanguard/{self.name}/" if self.name else "nanguard/"', 'prefix="nanguard/"',
           "two named guards write their scalars under the same nanguard/ tags"),
    # was ev-progress-count-float (an int count in the bar): since issue 29 the bar holds floats logged through
    # pl_module.log, and only from the first incident or LR cut on
    Mutant("events", "ev-progress-shown-when-healthy", PROGRESS,
           "if incidents == 0 and lr_scale == 1.0:  # healthy so far: nothing to say", "if False:",
           "a healthy fit shows ng_incidents / ng_lr_scale in the progress bar and callback_metrics (issue 29)"),
    # issue 29: a good guest in the user's Trainer
    Mutant("events", "ev-logger-step-is-global-step", RECORDER,
           "    return step if isinstance(step, int) else int(trainer.global_step)",
           "    return int(trainer.global_step)",
           "the guard's nanguard/* scalars are logged at global_step, not at Lightning's step for the batch "
           "(one step ahead, twice as far with two manual optimizers)"),
    Mutant("events", "ev-report-dir-in-checkpoint-folder", RECORDER,
           "    if not holders:", "    if True:",
           "docs/events.md: nanguard/ lands inside a ModelCheckpoint folder (dirpath=default_root_dir, logger=False)"),
    Mutant("events", "ev-sync-line-on-default-fit", STEP,
           'if check.sync != "auto":  # the user chose a mode', "if True:  # the user chose a mode",
           "a default fit prints the '[nanguard] sync: ...' line (nothing is printed on a healthy fit)"),
    Mutant("compat", "compat-say-to-classic-logger", CONSOLE,
           'unified = any(m.startswith("lightning.pytorch.") for m in modules)', "unified = False",
           "under lightning.pytorch the guard's lines go to pytorch_lightning's logger: the user's "
           "logging.getLogger('lightning.pytorch') level does not govern them"),
    Mutant("events", "ev-vocabulary-not-enforced", RECORDER,
           "event.validate(ACTIONS)", "pass",
           "an event whose cause is outside the documented vocabulary is recorded and written"),
    Mutant("events", "ev-spike-counted-as-incident", RECORDER,
           'self.counters.add("incidents" if KINDS[event.kind].incident else "spikes")',
           'self.counters.add("spikes" if event.kind == "spikes" else "incidents")',
           "a spike event counts as an incident (counters, scalars, progress bar, give-up message)"),

    # -------------------------------------------------------------------------------------------- config
    Mutant("config", "cfg-open-lower-bound", CONFIG,
           '(value <= lo if meta.get("lo_open") else value < lo)', "(value < lo)",
           "open lower bounds accept the bound (lr_factor: 0, clip.max_norm: 0)"),
    Mutant("config", "cfg-open-upper-bound", CONFIG,
           '(value >= hi if meta.get("hi_open") else value > hi)', "(value > hi)",
           "open upper bounds accept the bound (lr_factor: 1.0, ema_alpha: 1.0)"),
    Mutant("config", "cfg-nan-accepted", CONFIG,
           "if value != value:  # NaN", "if False:  # NaN",
           "a NaN config value passes every range check"),
    Mutant("config", "cfg-unknown-section-key", CONFIG,
           "if key not in known:", "if False:",
           "an unknown key inside a section gives a TypeError instead of a ConfigError naming it"),
    Mutant("config", "cfg-float-string-rejected", CONFIG,
           'if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string', "if False:",
           'a float written 1e-3 in YAML (read as the string "1e-3") is refused'),
    Mutant("config", "cfg-yaml-duplicates", CONFIG,
           "if duplicate:", "if False:",
           "a duplicate YAML key is silently resolved to the last value"),
    Mutant("config", "cfg-yaml-error-narrow", CONFIG,
           "except yaml.YAMLError as err:", "except yaml.scanner.ScannerError as err:",
           "only scanner errors get the line and column: a parser error falls to the generic message"),
    Mutant("config", "cfg-max-skips-zero", CONFIG,
           '"consecutive skipped steps before rolling back to a snapshot", lo=1)',
           '"consecutive skipped steps before rolling back to a snapshot", lo=0)',
           "recovery.max_skips: 0 is accepted (documented range is >= 1)"),
    Mutant("config", "cfg-min-lr-scale-zero", CONFIG,
           '"floor of the cumulative LR scale", lo=0.0, hi=1.0, lo_open=True)',
           '"floor of the cumulative LR scale", lo=0.0, hi=1.0)',
           "recovery.min_lr_scale: 0 is accepted (documented range is (0, 1])"),
    # new: the guard's name
    Mutant("config", "cfg-name-unchecked", CALLBACK,
           "if name is not None and (not isinstance(name, str) or not name.isidentifier()):",
           "if False:",
           "name='a/b' (not an identifier) is accepted: it becomes a folder path and a tag prefix"),

    # ---------------------------------------------------------------------------------------- checkpoint
    Mutant("checkpoint", "ckpt-optimizer-states-unchecked", CKPT,
           'for key in ("state_dict", "optimizer_states"):', 'for key in ("state_dict",):',
           "a checkpoint with an inf optimizer state (Adam exp_avg_sq) is written unchecked"),
    Mutant("checkpoint", "ckpt-rebuild-keeps-bad-optimizer", CKPT,
           'checkpoint["optimizer_states"] = [strategy.optimizer_state(o) for o in trainer.optimizers]', "pass",
           "the rebuilt checkpoint keeps the non-finite optimizer states it was written with"),
    Mutant("checkpoint", "ckpt-refusal-dropped", CALLBACK,
           "if still_bad:", "if False:",
           "with snapshot: off a checkpoint holding non-finite weights is written instead of refused"),
    Mutant("checkpoint", "ckpt-exempt-ignored", CKPT,
           'skip = {f"state_dict[{name!r}]" for name in exempt}', "skip = set()",
           "a checkpoint of a model with a -inf causal mask buffer triggers a parameter incident"),
    Mutant("checkpoint", "ckpt-resume-lr-scale", RECOVERY,
           'self.lr_scale = float(state.get("lr_scale", 1.0))', "self.lr_scale = 1.0",
           "a resumed run forgets its LR scale (the next cut and the floor are computed from 1.0)"),
    Mutant("checkpoint", "ckpt-resume-ladder-lost", LADDER,
           'self.unconfirmed_rollbacks = int(state.get("failed_rollbacks", 0))', "self.unconfirmed_rollbacks = 0",
           "a resumed run forgets its unconfirmed rollbacks (gives up later than configured)"),
    # issue 25: the layouts of the development builds before 0.1.0 (versions 1 and 2) are refused, no longer
    # upgraded (these two replace ckpt-v1-not-upgraded and ckpt-v1-event-index-lost, whose upgrade code is gone)
    Mutant("checkpoint", "ckpt-old-version-loaded", STATE_SCHEMA,
           "    if int(version) < current:\n", "    if int(version) < 1:\n",
           "a version-2 state (a layout from before 0.1.0) loads as if it were version 3: its counts are lost, and a "
           "resume from it neither fails nor says so"),
    Mutant("checkpoint", "ckpt-unversioned-state-loaded", STATE_SCHEMA,
           'version = state.get("version")', 'version = state.get("version", current)',
           "a state without a version (the version-1 layout) is taken as the current one and loads: the LR scale, "
           "ladder and event numbering silently start over"),
    # issue 24: the saved state is checked on resume
    Mutant("checkpoint", "doc-ckpt-state-nan-lr-scale-loaded", STATE_SCHEMA,
           '"lr_scale": real(lo=0.0, lo_open=True, hi=1.0),',
           '"lr_scale": real(nan=True, lo=0.0, lo_open=True, hi=1.0),',
           "docs/recovery.md: a NaN recovery.lr_scale in a checkpoint raises NaNGuardError naming it; here it loads "
           "and the first rollback makes the LR NaN"),
    Mutant("checkpoint", "doc-ckpt-state-statistics-kept", STATE_SCHEMA,
           "                reset.append(str(bad))\n                if key == \"\":",
           "                continue\n                if key == \"\":",
           "docs/recovery.md: malformed running statistics are reset with one warning; here they load as they are (a "
           "string clip history crashes the first incident after resume)"),
    Mutant("checkpoint", "doc-ckpt-lr-scale-not-reconciled", RECOVERY,
           "        self.lr_scale_known = \"lr_scale\" in state", "        self.lr_scale_known = True",
           "docs/recovery.md: a cut LR in the checkpoint's optimizer without recovery.lr_scale is taken as the LR "
           "scale, with a warning; here it is forgotten (lr_scale 1.0 while the optimizer runs at the cut LR)"),
    # a named guard's state_key
    Mutant("checkpoint", "ckpt-name-state-key-shared", CALLBACK,
           'return self._generate_state_key(name=self.name) if self.name else "NaNGuard"',
           'return "NaNGuard"',
           "two named guards share one state_key: their checkpoint state collides"),
    # ------------------------------------------------------------------------------------------ divergence
    # (issue 13: a finite run running away; a few only, the rules themselves change often)
    Mutant("divergence", "div-warn-acts", STEP,
           'act=check.divergence != "warn")',
           "act=True)",
           "check.divergence: warn skips, rolls back and cuts the LR like act"),
    Mutant("divergence", "div-rollback-before-onset-ignored", ACTIONS,
           "while self.before is not None and", "while False and self.before is not None and",
           "a divergence rolls back to the newest snapshot even if it was taken after the growth began"),
    Mutant("divergence", "div-snapshot-while-growing", STEP,
           " and not p.divergence.growing()", "",
           "a snapshot is taken while the loss grows towards a divergence (a rollback target that cannot help)"),
    Mutant("divergence", "div-no-cut-causes-cut", LADDER,
           'if policy.lr_cut == "never":',
           'if policy.lr_cut == "never" and not policy.arms_clip:',
           "actions stop following the cause: an overflow, precision or backward_op incident cuts the LR (the "
           "ladder reads another field of the cause table than lr_cut: only the causes that arm no clipping, "
           "input and transient, keep their no-cut policy)"),

    # --------------------------------------------------------------------------------------------- metrics
    # (issue 12: a skipped step leaves no trace in the user's metrics and Lightning's logged aggregates)
    Mutant("metrics", "met-undo-dropped", RECOVERY,
           "self.metrics.undo()", "pass",
           "a skipped step's metric updates are kept (a MeanMetric of the loss takes in the NaN batch)"),
    Mutant("metrics", "met-logged-aggregates-not-armed", RECOVERY,
           'self.metrics.arm(getattr(trainer, "_results", None))', "self.metrics.arm(None)",
           "Lightning's logged aggregates (train_loss_epoch, what EarlyStopping reads) keep a skipped step's value"),
    Mutant("metrics", "met-first-logged-key-kept", METRICS,
           "del results[key]", "pass",
           "a key first logged in a skipped step stays in the epoch's logged values"),
    Mutant("metrics", "met-list-states-kept", METRICS,
           "setattr(metric, attr, list(items))", "pass",
           "list states (a CatMetric, AUROC's preds) keep the skipped step's items"),
    Mutant("metrics", "met-given-up-hidden", STEP,
           "if outcome in (Outcome.INCIDENT, Outcome.SKIPPED) and not p.recovery.stopped:",
           "if outcome in (Outcome.INCIDENT, Outcome.SKIPPED):",
           "after giving up, the failed steps are hidden from the logs (EarlyStopping never sees the run fail)"),
    # recovery.restore_at_end (snapshots)
    Mutant("snapshots", "snap-end-restore-key-ignored", FIT_END,
           "elif p.config.recovery.restore_at_end:", "elif True:",
           "recovery.restore_at_end: false still restores the newest snapshot at fit end"),
    # (issue 20: the end of fit restores only suspect weights)
    Mutant("snapshots", "snap-end-skipped-incidents-not-restored", FINAL_WEIGHTS,
           "suspect = final is not False and snapshot is not True",
           "suspect = False",
           "a fit ending inside a streak of incidents that the final weights reproduce keeps the broken weights"),
    Mutant("snapshots", "snap-end-batch-fault-restored", FINAL_WEIGHTS,
           "suspect = final is not False and snapshot is not True",
           "suspect = final is not False",
           "a fit ending on NaN steps that are the batch's fault (NaN on the snapshot's weights too) throws "
           "away the healthy steps since the snapshot"),
    Mutant("snapshots", "snap-end-rerun-norm-ignored", REPLAY,
           "found = found or bool(grads) and not bool(torch.isfinite(total_norm(grads, norm_type)))",
           "found = found or False",
           "finite gradients whose total norm overflows do not count as reproduced at the end: a fit ending on "
           "such incidents keeps the broken weights"),
    Mutant("snapshots", "snap-end-param-rollback-restored", FINAL_WEIGHTS,
           "if recovery.unconfirmed_rollbacks > 0 and diverging:",
           "if recovery.unconfirmed_rollbacks > 0:",
           "the healthy steps after a rollback (of a one-off bad parameter, of a NaN streak) are thrown away at "
           "fit end while the rollback is unconfirmed"),
    Mutant("snapshots", "snap-end-divergence-not-restored", FINAL_WEIGHTS,
           "if recovery.unconfirmed_rollbacks > 0 and diverging:",
           "if False:",
           "a fit ending while the loss runs away again after an unconfirmed rollback keeps the diverging weights"),

    # ------------------------------------------------------------------------------------------------ sync
    # (issue 14: check.sync lagged: device-side skip through found_inf, flags read one step late)
    Mutant("sync", "sync-found-inf-not-set", AMP,
           "optimizer.found_inf = skip", "pass",
           "lagged: a fused optimizer is not told to skip on the device: the bad step is applied"),
    Mutant("sync", "sync-rollback-keeps-step-under-way", STEP,
           "return outcome, current and (done.stopped or done.rolled_back and not done.kept_step)",
           "return outcome, current and done.stopped",
           "lagged: a rollback read one step late lets the step under way apply gradients of the discarded weights"),
    Mutant("sync", "sync-no-flush-at-train-end", CALLBACK,
           "-> None:\n        self._flow.flush()", "-> None:\n        pass",
           "lagged: the last step's flags are never read (an incident at the last step goes unrecorded)",
           harmless="equivalent (judged after the i18 run, where it survived): in Lightning 2.x on_train_epoch_end "
                    "always runs after the last step and before on_train_end (max_steps mid-epoch, should_stop, "
                    "limit_train_batches: checked by hand), and it flushes the lagged step; the train-end flush "
                    "stays as a guard for a loop that ends an epoch without that hook"),
    Mutant("sync", "sync-no-flush-at-checkpoint", CALLBACK,
           "if self._flow.flush():", "if False:",
           "lagged: a checkpoint is written without the verdict of the step before it"),
    Mutant("sync", "sync-buffer-undo-inverted", UNDO,
           "b.copy_(torch.where(skip.to(b.device).bool(), self._backup[n], b))",
           "b.copy_(torch.where(skip.to(b.device).bool(), b, self._backup[n]))",
           "lagged: the device buffer undo restores BatchNorm statistics of healthy steps and keeps a skipped one's"),
    Mutant("sync", "sync-metrics-not-settled", STEP,
           "p.recovery.settle_metrics(skipped=flagged)", "p.recovery.settle_metrics(skipped=False)",
           "lagged: a device-skipped step's list states and update counts stay in the user's metrics"),

    # ---------------------------------------------------------------------------------------------- compat
    # (issue 12: the lightning package, LightningCLI usage errors, sparse layouts, torch.compile; the user's
    # anomaly mode) and weight checks on incidents (detection)
    Mutant("compat", "compat-lightning-not-subclassed", LIGHTNING,
           "class NaNGuard(_NaNGuard, _lp.Callback):", "class NaNGuard(_NaNGuard):",
           "lightning_nanguard.lightning.NaNGuard is not a lightning.pytorch.Callback: its LightningCLI refuses it"),
    Mutant("compat", "compat-usage-error-traceback", USAGE,
           'parser.error(f"NaNGuard init_args: {err}")', "pass",
           "under LightningCLI an out-of-range value is a long traceback, not a one-line usage error"),
    Mutant("compat", "compat-coo-values-unread", LAYOUTS,
           "return t._values()", "return None",
           "a sparse COO tensor is skipped by every check (a NaN in a sparse adjacency buffer goes unseen)"),
    Mutant("compat", "compat-sparse-buffer-not-restored", LAYOUTS,
           "_copy_back(module, name, buf, state[name])", "pass",
           "a rollback leaves a sparse buffer as the bad step left it"),
    Mutant("compat", "compat-compiled-replay-not-eager", REPLAY,
           '    with eager(), at_step(trainer, step):\n'
           "        return _replay_window(",
           '    with at_step(trainer, step):\n'
           "        return _replay_window(",
           "the replay of a torch.compile'd model re-traces it under the replay's hooks instead of running eagerly"),
    Mutant("compat", "compat-compiled-twin-keeps-methods", FLOAT64,
           'twin.__dict__.pop(key[len("original_"):], None)', "pass",
           "the float64 twin of a LightningModule compiled whole runs the original (float32) compiled methods"),
    Mutant("compat", "compat-compiled-names-orig-mod", PROBES,
           'return ".".join(part for part in name.split(".") if part != "_orig_mod") if "_orig_mod" in name else name',
           "return name",
           "a culprit in a compiled module is named with torch.compile's _orig_mod, not as the user wrote the model"),
    Mutant("compat", "compat-user-anomaly-mode-dropped", DIAGNOSER,
           "torch.autograd.set_detect_anomaly(*before)", "torch.autograd.set_detect_anomaly(False)",
           "a diagnosis turns the user's own anomaly mode (Trainer(detect_anomaly=True)) off for the rest of the fit"),
    Mutant("detection", "det-weights-not-read-on-incident", INCIDENT,
           "record, evidence, look=look, look_at_inputs=check_inputs,",
           "record, evidence, look=Look.NOTHING, look_at_inputs=check_inputs,",
           "a NaN weight read by the forward is reported as a loss incident and skipped, not named and rolled back "
           "(since issue 25 incident.nonfinite_step says which weights Responder._look looks at)"),
    Mutant("detection", "det-weights-not-checked-every-step", EVIDENCE,
           "return self.check.parameters and not (self.check.loss and self.check.gradients)", "return False",
           "with check.loss or check.gradients off, a bad update is not caught at the next step"),
    # ---- written from docs/ (issue 18 item 0) ----
    # An independent audit: each mutant below was written from a promise of README.md, docs/ or CONTRACT.md
    # (cited in its breaks text), without reading the tests.
    # ------------------------------------------------------------------ sync: check.sync lagged / auto
    Mutant("sync", "doc-lagged-event-step-number", RESPONDER,
           "return At.of(record, whereabouts(trainer))",
           "return At(trainer.global_step, record.epoch, record.batch_idx, record.log_step, whereabouts(trainer))",
           "docs/performance.md (check.sync table): a lagged step is judged one step later 'with the step's own "
           "number, epoch and batches'; here its event carries the step number of the step that read the flags "
           "(one too many)"),
    Mutant("sync", "doc-lagged-replays-next-window", STEP,
           "record.window = record.window.copy()  # the evidence's window is the next step's by the time it is "
           "judged",
           "pass",
           "docs/performance.md: a lagged step is judged 'with its own ... batches': here its replay and input "
           "findings look at the batches of the step under way instead (a NaN input of the lagged step is not "
           "named, kind is not 'input'); since issue 25 the incident reads record.window, so the bug is the staged "
           "record keeping the live window (StepFlow._stage) instead of its copy"),
    Mutant("sync", "doc-lagged-found-inf-not-set", AMP,
           "        optimizer.found_inf = skip\n        return True", "        return True",
           "docs/performance.md: with lagged reads a bad step is skipped on the device ('the skip flag is the "
           "optimizer's found_inf'), parameters/moments/step counts bitwise those of the host-side skip; here "
           "the fused optimizer never gets the flag, applies the bad step, and the guard believes it skipped"),
    Mutant("sync", "doc-lagged-no-device-clip", CLIPPING,
           "torch.nn.utils.clip_grads_with_norm_(params, limit, torch.where(",
           "torch.nn.utils.clip_grads_with_norm_([p.grad for p in params], limit, torch.where(",
           "docs/performance.md: lagged clipping (clip.max_norm, adaptive, a clip spike) is 'compared on the "
           "device with the same limit: the same gradients, bitwise'; given bare grad tensors "
           "clip_grads_with_norm_ silently clips nothing"),
    Mutant("sync", "doc-lagged-event-lrs-of-next-step", INCIDENT,
           'event.details["lr"] = [float(lr) for lr in record.lrs]',
           'event.details["lr"] = [float(g["lr"]) for g in record.optimizer.param_groups]',
           "docs/performance.md: a lagged step is judged one step later with its own step's evidence; here "
           "details.lr of its incident holds the learning rates at the read (after a per-step scheduler moved "
           "them), not those the bad step ran with"),
    Mutant("sync", "doc-lagged-metrics-not-undone-on-device", STEP,
           "p.recovery.undo_metrics_where(staged.skip)", "pass",
           "docs/performance.md: a lagged bad step's 'user's metric states' are 'restored on the device "
           "(torch.where on the skip flag)'; here a torchmetrics state keeps the skipped step's update"),
    Mutant("sync", "doc-lagged-buffers-not-undone-on-device", STEP,
           "p.recovery.undo_buffers_where(staged.skip)", "pass",
           "docs/performance.md: a lagged bad step's 'buffer writes (BatchNorm) ... restored on the device'; here "
           "BatchNorm running statistics keep the skipped step's batch"),
    Mutant("sync", "doc-lagged-weights-not-marked", STEP,
           "        p.evidence.after_step(self.responder.fit.module)  # read with the next step's flags\n"
           "        self._unread = staged",
           "        self._unread = staged",
           "docs/recovery.md (snapshots): 'never from poisoned state: the pending parameter flag is read "
           "first'; in lagged mode the weights a step left are not marked changed, so a non-finite weight no "
           "forward reads (Adam eps=0) is kept by the next snapshot / not found at validation start"),
    Mutant("sync", "doc-lagged-keeps-step-after-applied", STEP,
           "keep_step=current and not applied)", "keep_step=current)",
           "docs/performance.md: a lagged rollback happens 'before the next step's update: that step goes ahead "
           "when no update was applied since the snapshot ..., else it is skipped too'; here a step whose "
           "gradients were taken on the applied bad update goes ahead on the restored weights"),
    Mutant("sync", "doc-lagged-snapshot-one-step-late", STEP,
           "if p.recovery.snapshot_due(ahead=1) and not p.recovery.stopped:",
           "if p.recovery.snapshot_due() and not p.recovery.stopped:",
           "docs/performance.md: 'a due snapshot reads them at once' and docs/recovery.md: a snapshot every "
           "recovery.snapshot_every healthy steps; here lagged snapshots come one step late (not at the steps "
           "the eager mode takes them)"),
    Mutant("sync", "doc-lagged-train-end-unread", CALLBACK,
           "self._flow.flush()  # the last lagged step's flags", "pass",
           "docs/performance.md: 'train end ... read[s] them at once'; here the last lagged step of a fit is "
           "never judged (a NaN at the last step has no event, no rollback)",
           harmless="equivalent (judged after the i18 run, where it survived): in Lightning 2.x on_train_epoch_end "
                    "always runs after the last step and before on_train_end (max_steps mid-epoch, should_stop, "
                    "limit_train_batches: checked by hand), and it flushes the lagged step; the train-end flush "
                    "stays as a guard for a loop that ends an epoch without that hook"),
    Mutant("sync", "doc-lagged-checkpoint-not-rebuilt", CALLBACK,
           "            rebuild(checkpoint, trainer, self.state_key, self.state_dict())\n"
           "        if not self.config.check.parameters:",
           "            pass\n        if not self.config.check.parameters:",
           "docs/performance.md: a checkpoint reads the lagged flags at once, and docs/recovery.md: the "
           "checkpoint is 'rebuilt from the restored state'; here the checkpoint keeps the weights and guard "
           "state from before the lagged step's verdict (and rollback)"),
    Mutant("sync", "doc-lagged-spike-not-skipped-on-device", STEP,
           "            skip = torch.maximum(skip, spike.float())", "            pass",
           "docs/recovery.md (spike_action skip_step: 'step not applied') and docs/performance.md (a loss spike "
           "acts on its own step in lagged mode): here a lagged skip_step spike is applied on the device while "
           "the event says skip_step"),
    Mutant("sync", "doc-lagged-applied-step-not-rolled-back", RESPONDER,
           "plan = p.recovery.step_was_applied(plan)",
           "pass",
           "docs/performance.md: 'non-fused optimizers without a GradScaler: the bad step is applied and rolled "
           "back to the newest snapshot when read'; here it is applied and kept"),
    Mutant("sync", "doc-lagged-applied-step-gives-up-late", LADDER,
           "        if self.unconfirmed_rollbacks >= self.cfg.max_rollbacks:\n            draft.give_up = True",
           "        if self.unconfirmed_rollbacks > self.cfg.max_rollbacks:\n            draft.give_up = True",
           "docs/recovery.md (give up when a rollback is needed and recovery.max_rollbacks rollbacks in a row are "
           "unconfirmed): a run of applied bad steps (lagged, non-fused) rolls back once more than allowed"),
    Mutant("sync", "doc-sync-auto-lagged-on-cpu", READ_MODE,
           'if device is None or torch.device(device).type == "cpu":', "if device is None:",
           "docs/performance.md / configuration.md: check.sync auto is lagged only 'when the device is not the "
           "CPU'; 'On the CPU ... auto reads eagerly there'; here a CPU fit with a fused optimizer goes lagged"),
    Mutant("sync", "doc-sync-manual-lagged", READ_MODE,
           '    if not getattr(pl_module, "automatic_optimization", True):\n        return False, "manual',
           '    if False:\n        return False, "manual',
           "docs/distributed.md: under manual optimization 'every optimizer.step() is guarded on its own' "
           "(choose_read_mode: manual optimization always reads eagerly); here check.sync lagged/auto judges a manual "
           "step one step late"),
    # ------------------------------------------------------------------ ranks: DDP, which rank an event names
    Mutant("ranks", "doc-ranks-highest-rank-named", ACCOUNT,
           'best = max(gathered, key=lambda p: (p["evidence"], -p["rank"]))',
           'best = max(gathered, key=lambda p: (p["evidence"], p["rank"]))',
           "docs/distributed.md: the event names 'the lowest rank whose own flags were set'; here the highest"),
    Mutant("ranks", "doc-ranks-own-diagnosis-over-flags", ACCOUNT,
           "3 if any(own_flags)\n            else 2 if inputs or event.op",
           "2 if any(own_flags)\n            else 3 if inputs or event.op",
           "docs/distributed.md: a rank whose own flags were set wins over one whose diagnosis found something "
           "of its own; here the precedence is swapped"),
    Mutant("ranks", "doc-ranks-details-ranks-all", ACCOUNT,
           'named = [p["rank"] for p in gathered if p["evidence"] >= floor]',
           'named = [p["rank"] for p in gathered]',
           "docs/distributed.md: 'details.ranks lists the ranks with evidence'; here every rank"),
    Mutant("ranks", "doc-ranks-lagged-local-vector", RESPONDER,
           "account = share_incident(p.ranks, event, extra, record.local if record else None,",
           "account = share_incident(p.ranks, event, extra, None,",
           "docs/distributed.md + performance.md: with lagged reads the event names the rank whose own flags "
           "were set at the incident's step; here the rank flags of the step under way (the last reduced "
           "vector) are used, so the wrong rank (or none) is named",
           harmless="equivalent (judged after the 2d475bd run, where it survived; still so after issue 25): only "
                    "StepEvidence.vector calls Ranks.reduce, and in a lagged fit no reduce runs between a step's "
                    "_stage and its read (_judge_late runs before the next _stage; every flush judges the step "
                    "just staged), so ranks.last_local is record.local itself"),
    Mutant("ranks", "doc-ranks-flags-not-reduced", RANKS,
           "dist.all_reduce(out[summed], group=self.group)",
           'dist.all_reduce(out[SCHEMA.index["loss"]:SCHEMA.index["loss"] + 1], group=self.group)',
           "docs/distributed.md: the rank-local flags are summed across ranks so that 'every rank takes the "
           "same decision at the same step'; here only the loss is reduced and a NaN input on one rank skips "
           "the step there only"),
    Mutant("ranks", "doc-ranks-sharded-norm-not-rooted", RANKS,
           "out[norm] = out[norm].clamp_min(0).pow(1.0 / self.norm_type)",
           "out[norm] = out[norm].clamp_min(0)",
           "docs/distributed.md (FSDP): the guard sums |g|^p over its shards and 'the same all-reduce completes "
           "the total norm, which is then used for the finite check and for clipping'; here the norm stays a "
           "sum of squares"),
    # (issue 35: sharded diagnosis as good as one process)
    Mutant("ranks", "shard-received-counts-as-own", ACCOUNT,
           "    if received:  # its replay showed", "    if False:  # its replay showed",
           "a rank whose non-finite values came through a collective (TP's all-reduce, FSDP2's reduce-scatter) "
           "counts as having reproduced them: the lowest rank is named, not the one whose batch made them"),
    Mutant("ranks", "shard-no-op-search", LOCKSTEP,
           "    if need_op:\n", "    if False:\n",
           "the sharded replay skips the op search: no op, and overflow / domain cannot be judged at the op"),
    Mutant("ranks", "shard-no-backward-pass", LOCKSTEP,
           "    if need_backward:\n", "    if False:\n",
           "the sharded replay skips the backward's pass: no backward op, no anomaly finding; FSDP2 ranks all look as "
           "if they had received the NaN"),
    Mutant("ranks", "shard-no-float64", LOCKSTEP,
           "    if float64_check and not lock.stopped:\n", "    if False:\n",
           "the sharded replay never runs the float64 pass on the gathered model: precision cannot be told apart"),
    Mutant("ranks", "shard-hook-nan-taken-as-received", LOCKSTEP,
           "return _REDUCED if local_finite else None", "return _REDUCED",
           "under sharding a NaN a tensor hook wrote into one rank's own backward (no autograd node made it) is taken "
           "for one the gradients' reduction brought: no rank reproduces it and the fault is called transient"),
    Mutant("ranks", "shard-timeout-never-stops", LOCKSTEP,
           "if values[-1] and self.stopped_at is None:", "if False:",
           "anomaly.replay_timeout never ends a sharded replay"),
    Mutant("ranks", "divergence-not-shared", INCIDENT,
           "ActAtStepEnd(), record, evidence, diagnose=True, share=True,",
           "ActAtStepEnd(), record, evidence, diagnose=True,",
           "a divergence event keeps each rank's own rank, host and diagnosis (under FSDP2 its own LR cut): the ranks' "
           "events differ"),
    Mutant("ranks", "doc-ranks-every-rank-writes-jsonl", RECORDER,
           'if trainer.global_rank != 0:\n'
           '            return sinks\n'
           '        if cfg.events_file:\n'
           '            sinks.append(JsonlSink(self.out_dir / "events.jsonl"))',
           'if cfg.events_file:\n'
           '            sinks.append(JsonlSink(self.out_dir / "events.jsonl"))\n'
           '        if trainer.global_rank != 0:\n'
           "            return sinks",
           "docs/distributed.md / events.md: 'events.jsonl ... come[s] from global rank 0 only'; here every "
           "rank appends the event to the same file"),
    # ------------------------------------------------------------------ sparse layouts
    Mutant("sparse", "doc-sparse-csc-bsc-unread", LAYOUTS,
           "if layout in COMPRESSED or t.is_nested:\n        return t.values()",
           "if layout in (torch.sparse_csr, torch.sparse_bsr) or t.is_nested:\n        return t.values()",
           "docs/compatibility.md: a sparse buffer or batch tensor in CSC or BSC layout is 'checked through its "
           "stored values'; here column-compressed layouts are skipped as unreadable (a NaN in one is missed)"),
    Mutant("sparse", "doc-sparse-norm-drops-sparse", KERNELS,
           "values = [v for v in (t if is_strided(t) else stored_values(t) for t in tensors) if v is not None]",
           "values = [t for t in tensors if is_strided(t)]",
           "docs/compatibility.md: 'Sparse gradients count in the gradient norm and are clipped'; here the "
           "sparse gradients of nn.Embedding(sparse=True) are left out of the norm (a NaN in one is not seen)"),
    Mutant("sparse", "doc-sparse-norm-uncoalesced", KERNELS,
           "values = [v for v in (t if is_strided(t) else stored_values(t) for t in tensors) if v is not None]",
           "values = [v for v in (t if is_strided(t) else stored_values(t, coalesce=False) for t in tensors) if "
           "v is not None]",
           "docs/compatibility.md + recovery.md: sparse gradients count in the total gradient norm (the same "
           "arithmetic as torch's total norm); here an uncoalesced COO gradient (repeated indices) is measured "
           "without summing its duplicates, so the norm and the clip differ"),
    Mutant("sparse", "doc-sparse-snapshot-aliases-live", SNAPSHOTS,
           "                buffers[i] = copy_to_cpu(src)",
           "                buffers[i] = src",
           "docs/compatibility.md: sparse buffers are 'snapshotted and restored in their own layout'; here the "
           "snapshot keeps the live sparse tensor itself, so an in-place change (a NaN written into its values) "
           "also poisons the snapshot a rollback restores"),
    Mutant("sparse", "doc-sparse-resparsified-csr-not-restored", LAYOUTS,
           "    owner._buffers[attr] = saved.detach().clone().to(current.device)", "    return",
           "docs/compatibility.md: 'a CSR buffer rebuilt with another sparsity is put back whole' by a rollback; "
           "here it keeps the current (e.g. poisoned) buffer"),
    Mutant("sparse", "doc-sparse-input-samples-all-rows", FIND,
           'out["samples"] = indices[0][per_entry].unique()[:limit].tolist()',
           'out["samples"] = indices[0].unique()[:limit].tolist()',
           "docs/compatibility.md: a bad entry of a sparse batch tensor 'is named by its row and column "
           "(details.inputs[*].samples / features)'; here samples lists every stored row, not the bad ones"),
    Mutant("sparse", "doc-sparse-state-flag-skips-layouts", WEIGHTS,
           "self._layouts = [(n, t) for n, t in named if not is_strided(t)]",
           "self._layouts = []",
           "docs/compatibility.md: a sparse adjacency buffer is checked through its stored values, and "
           "docs/recovery.md: a snapshot is never taken from poisoned state; here the fused weight flag read "
           "before a snapshot (and every step with check.loss/gradients off) leaves sparse buffers out"),
    # ------------------------------------------------------------------ diagnosis rules and their order
    Mutant("diagnosis", "doc-diag-inputs-off-ignored", INCIDENT,
           "look_at_inputs=check_inputs, diagnose=True,",
           "look_at_inputs=True, diagnose=True,",
           "docs/diagnosis.md (kind): refined to 'input when non-finite values are found in the step's batch "
           "(unless check.inputs: 'off')'; here check.inputs: off still looks at the batch and says input (the "
           "step incident's builder ignores its check_inputs; diag-inputs-off-ignored drops it at the caller)"),
    Mutant("diagnosis", "doc-diag-backward-op-beats-initialization", RULES,
           '    if cause is None and (found == "backward_op" or data_explained):',
           '    if found == "backward_op" or data_explained:',
           "docs/diagnosis.md rule 4a: initialization (a weight 1000x 1/sqrt(fan_in) at fit start and now) "
           "'wins over any replay finding'; here a backward_op (or data-explained) finding wins over it"),
    Mutant("diagnosis", "doc-diag-exploding-before-learning-rate", RULES,
           '    if cause is None and module is not None:\n'
           '        cause = _learning_rate(ctx)\n'
           '    if cause is None:\n'
           "        cause = _exploding(ctx, rows)",
           '    if cause is None:\n'
           '        cause = _exploding(ctx, rows)\n'
           '    if cause is None and module is not None:\n'
           "        cause = _learning_rate(ctx)",
           "docs/diagnosis.md: rule 4c (learning_rate: relative update >= 1) comes before 4d "
           "(exploding_gradient); here a too-high LR whose gradient norm grew is called exploding_gradient (and "
           "cut by lr_factor instead of to the safe LR)"),
    Mutant("diagnosis", "doc-diag-symptom-dropped", RULES,
           '        diagnosis.symptom = found',
           "        pass",
           "docs/diagnosis.md: 'When 4a, 4c or 4d replaces an overflow or precision finding, that finding is "
           "kept in details.symptom'"),
    Mutant("diagnosis", "doc-diag-anomaly-op-preferred", RULES,
           'ev.op = (res.backward_op or {}).get("op") or (res.anomaly or {}).get("op")',
           'ev.op = (res.anomaly or {}).get("op") or (res.backward_op or {}).get("op")',
           "docs/diagnosis.md (backward): 'op prefers the graph hooks' (SqrtBackward0, where the Inf appeared) "
           "over anomaly mode (MulBackward0, where inf*0 became NaN)"),
    Mutant("diagnosis", "doc-diag-max-replays-off-by-one", DIAGNOSER,
           'self.counters["replays"] < self.cfg.max_replays',
           'self.counters["replays"] <= self.cfg.max_replays',
           "docs/diagnosis.md: 'At most anomaly.max_replays incidents are replayed per fit'; here one more"),
    Mutant("diagnosis", "doc-diag-reuse-any-kind", RULES,
           "ctx.previous is not None and ctx.previous[0].kind == ev.kind and ctx.previous[0].cause",
           "ctx.previous is not None and ctx.previous[0].cause",
           "docs/diagnosis.md: after max_replays 'an incident of the same kind takes the diagnosis of the last "
           "replayed one'; here an incident of another kind takes it too"),
    Mutant("diagnosis", "doc-diag-manual-replayed", DIAGNOSER,
           'ctx.replay = (self.cfg.mode != "off" and self.counters["replays"] < self.cfg.max_replays\n'
           '                      and getattr(ctx.pl_module, "automatic_optimization", True))',
           'ctx.replay = (self.cfg.mode != "off" and self.counters["replays"] < self.cfg.max_replays)',
           "docs/diagnosis.md + distributed.md: under manual optimization incidents are not replayed ('running "
           "training_step again would step the optimizers')"),
    Mutant("diagnosis", "doc-diag-buffer-kind-any", INCIDENT,
           'return "buffer" if all(f["name"] in buffers for f in param_findings) else "parameter"',
           'return "buffer" if any(f["name"] in buffers for f in param_findings) else "parameter"',
           "docs/diagnosis.md (kind): 'buffer when every non-finite tensor found is a buffer'; here one non-finite "
           "buffer among non-finite parameters makes the event a buffer event (since issue 25 incident.kind_of "
           "decides the kind of every incident)"),
    Mutant("diagnosis", "doc-diag-loss-before-activation", VECTOR,
           '    Field("activation_bad", "sum", kind="activation", '
           'help="a module output was non-finite (check.activations)"),\n'
           '    Field("loss_bad", "sum", kind="loss", help="a micro-batch loss was non-finite (check.loss)"),\n',
           '    Field("loss_bad", "sum", kind="loss", help="a micro-batch loss was non-finite (check.loss)"),\n'
           '    Field("activation_bad", "sum", kind="activation", '
           'help="a module output was non-finite (check.activations)"),\n',
           "docs/diagnosis.md (kind precedence: parameter, input, activation, loss, gradient): with "
           "check.activations always a NaN activation that also spoils the loss is kind 'activation'; here "
           "'loss'"),
    Mutant("diagnosis", "doc-diag-safe-lr-ignores-edge", DYNAMICS,
           "safe_lr=min(safe, edge / EDGE_MARGIN))",
           "safe_lr=safe)",
           "docs/diagnosis.md rule 4c / recovery.md: for SGD whose gradient norm grew geometrically 'safe_lr is "
           "then at most a quarter of edge_lr'; here the edge of stability is reported but not used"),
    # ------------------------------------------------------------------ divergence watch
    Mutant("divergence", "doc-div-no-record-condition", DIVERGENCE,
           "growth_streak(losses, self.growth) >= self.steps and losses[-1] >= RECORD_FACTOR * self.loss_max",
           "growth_streak(losses, self.growth) >= self.steps and losses[-1] >= self.loss_max",
           "docs/recovery.md (divergence rule 1): the loss grew g-fold at each of k steps 'to 10x every loss "
           "before that streak'; here a new record of any size is enough (noisy small-batch losses diverge)"),
    Mutant("divergence", "doc-div-grad-norm-alone", DIVERGENCE,
           "\n              and (_ratio(losses[0], losses[-1]) or 0.0) >= self.growth):", "):",
           "docs/recovery.md (divergence rule 3): a gradient-norm growth counts only 'while the loss grew g-fold "
           "over the same steps' (warm-up, zero-initialised layers: the loss then falls)"),
    Mutant("divergence", "doc-div-far-above-k-steps", DIVERGENCE,
           "if len(self.above) < self.steps + 2:", "if len(self.above) < self.steps:",
           "docs/recovery.md (divergence rule 4): the loss must stay above F x the first loss 'for k + 2 steps'; "
           "here k suffice"),
    Mutant("divergence", "doc-div-streak-never-rearms", DIVERGENCE,
           "< self.growth:\n            self.streak_latched = False", "< self.growth:\n            pass",
           "docs/recovery.md: 'One event per episode' and the divergence docstring: the growth rules re-arm after "
           "a step without growth; here after the first growth event no later episode is ever reported"),
    Mutant("divergence", "doc-div-far-above-never-rearms", DIVERGENCE,
           "self.above, self.latched = [], False", "self.above = []",
           "docs/recovery.md (one event per episode): the far-above rule re-arms once the loss is back below F x "
           "the first loss; here it fires once per fit"),
    Mutant("divergence", "doc-div-same-episode-twice", DIVERGENCE,
           "        self.latched = self.latched or bool(self.above)", "        pass",
           "docs/recovery.md: 'One event per episode' (an event of either rule silences the other meanwhile); "
           "here a growth event is followed by a far-above event for the same episode"),
    Mutant("divergence", "doc-div-rollback-to-newest", INCIDENT,
           'rollback_before=found.get("onset_step")',
           "rollback_before=None",
           "docs/recovery.md: 'a divergence goes back to the newest snapshot taken at or before the step where "
           "the growth began'; here to the newest snapshot, even one taken during the growth"),
    Mutant("divergence", "doc-div-snapshot-while-growing", STEP,
           "and not p.clipper.diverging() and not p.divergence.growing():",
           "and not p.clipper.diverging():",
           "docs/recovery.md: 'snapshots are deferred while the loss grows g-fold twice in a row, or stays far "
           "above its first value'"),
    Mutant("divergence", "doc-div-watch-not-in-snapshots", PARTS,
           ', "divergence": divergence})',
           "})",
           "docs/recovery.md: the divergence statistics 'are part of every snapshot, and are restored by a "
           "rollback, so statistics gathered while a run diverged cannot blind the checks afterwards'"),
    # ------------------------------------------------------------------ learning-rate cuts
    Mutant("lr", "doc-lr-plateau-min-lrs-not-scaled", LR,
           '_SCHED_LR_ATTRS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "eta_min", "end_lr")',
           '_SCHED_LR_ATTRS = ("base_lrs", "_last_lr", "max_lrs", "eta_min", "end_lr")',
           "docs/recovery.md: ReduceLROnPlateau keeps a cut and 'its min_lr is scaled too'; here its min_lrs "
           "stays, so a cut below it is clamped back up by its next reduction"),
    Mutant("lr", "doc-lr-eta-min-not-scaled", LR,
           '_SCHED_LR_ATTRS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "eta_min", "end_lr")',
           '_SCHED_LR_ATTRS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs", "end_lr")',
           "docs/recovery.md: CosineAnnealingLR 'with eta_min' keeps a cut (eta_min is scaled); here the "
           "schedule's floor stays unscaled"),
    Mutant("lr", "doc-lr-onecycle-initial-lr-not-scaled", LR,
           '_GROUP_LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr", "base_lr")',
           '_GROUP_LR_KEYS = ("lr", "max_lr", "min_lr", "base_lr")',
           "docs/recovery.md: a cut scales 'in each param group: lr, initial_lr, max_lr, min_lr, base_lr' "
           "(OneCycleLR recomputes its warm-up from initial_lr); here initial_lr is left, and the schedule "
           "undoes the cut during warm-up"),
    Mutant("lr", "doc-lr-rollback-inverse-reapply", RECOVERY,
           "self.lr_scale / snap_scale)", "snap_scale / self.lr_scale)",
           "docs/recovery.md: a rollback 're-applies the LR cuts made since the snapshot was taken'; here it "
           "undoes them a second time (the LR goes up instead of staying cut)"),
    Mutant("lr", "doc-lr-sized-cut-every-rollback", LADDER,
           'not (by_cause or by_runaway or by_count):\n'
           "            self.sized_cut = False",
           'not (by_cause or by_runaway or by_count):\n'
           "            pass",
           "docs/recovery.md: after a sized cut 'the first rollback of the same episode ... does not cut "
           "again'; only the first: here no later failed rollback of the episode cuts either"),
    Mutant("lr", "doc-lr-sized-cut-not-reset-by-snapshot", LADDER,
           "        self.unconfirmed_rollbacks = 0\n        self.sized_cut = False",
           "        self.unconfirmed_rollbacks = 0",
           "docs/recovery.md: a sized cut spares 'the first rollback of the same episode (until a snapshot "
           "confirms it)'; here the exemption outlives the confirming snapshot, so the first forced rollback of "
           "a later, unrelated episode does not cut the LR"),
    Mutant("lr", "doc-lr-episode-cause-drives-policy", LADDER,
           "        policy = cause_entry(None) if echo else cause_entry(cause)",
           "        policy = cause_entry(episode.cause if episode is not None else cause)",
           "docs/recovery.md (the episode's cause): 'the policy is always the incident's own diagnosis'; here an "
           "incident that inherits learning_rate is planned as learning_rate (issue 26's reverted attempt: the "
           "sized cut is made again, 4 cuts and a give-up)"),
    Mutant("lr", "doc-lr-episode-echo-cuts-again", LADDER,
           "        echo = self._echoes(episode, cause, safe_factor)", "        echo = False",
           "docs/recovery.md (the episode's cause): a learning_rate only reused from an earlier incident "
           "(anomaly.max_replays spent) with no safe LR below the current one is planned like an unknown one; here "
           "it cuts the LR again at the first incident of each streak"),
    Mutant("ladder", "doc-episode-outlives-snapshot", LADDER,
           "        self.sized_cut = False\n        self.episode = None", "        self.sized_cut = False",
           "docs/recovery.md (the episode's cause): a confirming snapshot ends the episode; here an unknown "
           "incident of a later, unrelated episode still reports the old cause"),
    Mutant("ladder", "doc-episode-window-ignored", LADDER,
           "if episode is not None and step - episode.last >= self.cfg.incident_window:", "if False:",
           "docs/recovery.md (the episode's cause): an episode ends recovery.incident_window steps after its "
           "latest incident; here it lasts until a snapshot"),
    Mutant("events", "doc-episode-cause-not-reported", RESPONDER,
           "            if plan.suggestion is not None:", "            if False:",
           "docs/recovery.md (the episode's cause): an unknown incident of a learning_rate episode reports "
           "learning_rate in events.jsonl; here the ladder's answer is dropped and it reports unknown"),
    Mutant("lr", "doc-lr-param-rollback-cuts", LADDER,
           "by_rollback = wants_rollback and not what.weights and self.cfg.reduce_lr_on_rollback",
           "by_rollback = wants_rollback and self.cfg.reduce_lr_on_rollback",
           "docs/recovery.md: 'A one-off bad parameter never cuts the learning rate' (configuration.md "
           "reduce_lr_on_rollback: not for a one-off bad parameter)"),
    Mutant("lr", "doc-lr-divergence-by-lr-factor", LADDER,
           'if policy.lr_cut == "sized" or by_runaway:\n'
           "                plan.lr_factor",
           'if policy.lr_cut == "sized":\n'
           "                plan.lr_factor",
           "docs/recovery.md: a divergence event cuts the LR 'at once, by recovery.divergence_lr_factor'; here "
           "a divergence diagnosed exploding_gradient/unknown is cut by recovery.lr_factor"),
    # ------------------------------------------------------------------ loss spikes
    Mutant("spikes", "doc-spike-window-boundary", SPIKES,
           "self._recent = [s for s in self._recent if s > step - window] + [step]",
           "self._recent = [s for s in self._recent if s >= step - window] + [step]",
           "docs/recovery.md: 'Three spikes within recovery.incident_window steps cut the LR'; here a spike "
           "exactly incident_window steps old still counts"),
    Mutant("spikes", "doc-spike-unclamped-update", SPIKES,
           "        stats.update(capped)", "        stats.update(loss)",
           "docs/recovery.md: 'each loss enters them clamped to mean +- spike_z x spread' (one spike neither hides "
           "the next nor shifts the baseline)"),
    Mutant("spikes", "doc-spike-no-std-floor", SPIKES,
           "max(stats.std, self.rel_floor * abs(stats.mean), PEAK_SHARE * self.peak, 1e-12)",
           "max(stats.std, PEAK_SHARE * self.peak, 1e-12)",
           "docs/recovery.md: the spike test's spread is at least '1% of |mean|' (an almost constant loss does not "
           "turn a 1% wobble into a spike)"),
    Mutant("spikes", "doc-spike-no-peak", SPIKES,
           "max(stats.std, self.rel_floor * abs(stats.mean), PEAK_SHARE * self.peak, 1e-12)",
           "max(stats.std, self.rel_floor * abs(stats.mean), 1e-12)",
           "docs/recovery.md: the spread is at least half the peak, so that the heavy tail of per-batch losses "
           "widens the test (issue 24: 317 false spikes on the long healthy corpus without it)"),
    Mutant("spikes", "doc-spike-peak-takes-the-whole-spike", SPIKES,
           "self.peak = max(capped - mean, self.peak * PEAK_DECAY)",
           "self.peak = max(loss - mean, self.peak * PEAK_DECAY)",
           "docs/recovery.md: 'a spike counts up to the threshold' in the peak; here one spike widens the test so "
           "much that the next ones of its size are hidden"),
    Mutant("spikes", "doc-spike-cause-one-step", RULES,
           "if len(norms) > steps and growth_streak(norms, growth) >= steps:",
           "if len(norms) > steps and growth_streak(norms, growth) >= 1:",
           "docs/recovery.md: a spike is exploding_gradient only when the gradient norm grew at each of the last "
           "check.divergence_steps steps; here one large norm (a hard batch) is enough"),
    Mutant("spikes", "doc-spike-clip-to-threshold", STEP,
           "clip_to=p.clipper.zclip.mean,",
           "clip_to=p.clipper.zclip.threshold(),",
           "docs/recovery.md (spike_action clip): 'this step's gradient is clipped to the mean of healthy norms'"),
    # ------------------------------------------------------------------ clipping
    Mutant("clipping", "doc-clip-persists-after-11", CLIPPING,
           "return self.armed and self.zclip.streak >= CLIPS_BEFORE_LR_CUT",
           "return self.armed and self.zclip.streak > CLIPS_BEFORE_LR_CUT",
           "docs/recovery.md: 'When adaptive clipping acts on 10 consecutive steps' the step is skipped, rolled "
           "back and the LR cut (a spike event); here only on the 11th"),
    Mutant("clipping", "doc-clip-agc-eps", CLIPPING,
           "eps: float = AGC_EPS,", "eps: float = 1e-6,",
           "docs/recovery.md (AGC): every unit keeps ||g_row|| <= factor * max(||w_row||, 1e-3); here zero or "
           "tiny weights (a zero-initialised layer) get their gradients clipped to almost nothing"),
    # ------------------------------------------------------------------ checkpoints and the end of fit
    Mutant("checkpoint", "doc-ckpt-guard-state-not-rebuilt", CKPT,
           "        callbacks[guard_key] = guard_state", "        pass",
           "docs/recovery.md: a bad checkpoint 'is rebuilt from the restored state', and 'Resuming restores "
           "counters, the LR scale, the ladder, the running statistics and the event numbering'; here the "
           "guard state in it is from before the checkpoint-time incident (its rollback and event are lost on "
           "resume)"),
    Mutant("checkpoint", "doc-ckpt-optimizer-state-not-rebuilt", CKPT,
           '        checkpoint["optimizer_states"] = [strategy.optimizer_state(o) for o in trainer.optimizers]',
           "        pass",
           "docs/recovery.md: after a checkpoint-time incident 'the checkpoint is rebuilt from the restored "
           "state'; here its optimizer states are the bad ones (and the write then fails although a snapshot "
           "exists)"),
    Mutant("checkpoint", "doc-ckpt-mask-not-exempt", CALLBACK,
           "        bad = nonfinite_entries(checkpoint, exempt=exempt)", "        bad = nonfinite_entries(checkpoint)",
           "docs/recovery.md: buffers non-finite before training (a float causal mask of -inf) 'are taken as "
           "intentional ... and never checked'; here every checkpoint of such a model is an incident"),
    Mutant("checkpoint", "doc-ckpt-written-without-snapshot", CALLBACK,
           "        if still_bad:", "        if False:",
           "docs/recovery.md: 'Without a snapshot the write fails with NaNGuardError' (snapshot: off: 'a "
           "checkpoint holding non-finite state is refused'); here it is written"),
    Mutant("checkpoint", "doc-end-input-skips-any", CAUSE_TABLE,
           'in_incident_window=False,\n'
           '          weights_suspect=False,\n'
           '          advice="Bad input data',
           'in_incident_window=False,\n'
           '          weights_suspect=True,\n'
           '          advice="Bad input data',
           "docs/recovery.md (end of fit, rewritten by issue 20): 'bad inputs never make the weights suspect'; "
           "here the input cause's entry says its weights may be broken, so a fit ending on skipped bad inputs "
           "whose batch cannot be rerun (anomaly.mode: off) is rolled back to the newest snapshot (was: only "
           "skipped bad inputs leave nothing to restore, and one input among loss incidents did)"),
    Mutant("checkpoint", "doc-end-param-rollback-restored", FINAL_WEIGHTS,
           "if recovery.incidents_in_a_row > 0 and incidents:",
           "if (recovery.incidents_in_a_row > 0 or recovery.unconfirmed_rollbacks > 0) and incidents:",
           "docs/recovery.md (end of fit, rewritten by issue 20): 'the healthy steps after a rollback are good "
           "steps' (was: after rolling back a one-off bad parameter); here an unconfirmed rollback counts as a "
           "streak still under way, so the end of fit reruns the last incident (or, its batch not kept, takes "
           "it as suspect) and restores the snapshot over the healthy steps"),
    # ------------------------------------------------------------------ snapshots and rollback
    Mutant("snapshots", "doc-snap-schedulers-not-kept", SNAPSHOTS,
           '"schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],',
           '"schedulers": [],',
           "docs/recovery.md: a snapshot holds 'every LR scheduler' and a rollback loads it into the live "
           "schedulers; here their step count and LR are not rolled back"),
    Mutant("snapshots", "doc-snap-scaler-not-restored", SNAPSHOTS,
           'if scaler is not None and saved:',
           "if False:",
           "docs/recovery.md / distributed.md: 'Snapshots include the scaler and a rollback restores it'"),
    Mutant("snapshots", "doc-snap-confirm-cadence-inverted", RECOVERY,
           "        if self._ladder.unconfirmed_rollbacks:",
           "        if not self._ladder.unconfirmed_rollbacks:",
           "docs/recovery.md: snapshots every recovery.snapshot_every healthy steps, 'recovery.confirm_after "
           "while a rollback awaits confirmation'; here the two cadences are swapped"),
    Mutant("snapshots", "doc-snap-skip-batches-one-short", ACTIONS,
           "hands.recovery.skip_batches_left = self.n", "hands.recovery.skip_batches_left = self.n - 1",
           "docs/recovery.md: 'With recovery.skip_batches: N, the steps of the N batches after a rollback are "
           "skipped too'; here N - 1"),
    Mutant("snapshots", "doc-snap-skip-batches-buffers-kept", RECOVERY,
           '        self.skip_batches_left -= 1\n'
           "        self.undo_buffers()",
           "        self.skip_batches_left -= 1",
           "docs/recovery.md: a step skipped after a rollback (skip_batches) is skipped like an incident's: "
           "'What the step's forward passes wrote into buffers is undone'; here BatchNorm keeps the skipped "
           "batches"),
    Mutant("snapshots", "doc-snap-disk-no-fsync", WRITER,
           "            os.fsync(fh.fileno())",
           "            pass",
           "docs/recovery.md: recovery.snapshot: disk 'writes each snapshot with torch.save to a temporary "
           "file, fsyncs it and renames it' (on the writer thread since issue 20: store/writer.py's "
           "write_atomic)"),
    # ------------------------------------------------------------------ 16-mixed / GradScaler
    Mutant("amp", "doc-amp-overflows-not-consecutive", AMP,
           "        if not grads_bad:\n            self.overflows = 0\n            return False",
           "        if not grads_bad:\n            return False",
           "docs/distributed.md: overflows become an incident after check.amp_overflow_patience 'consecutive' "
           "overflows; here isolated overflows add up over the fit"),
    Mutant("amp", "doc-amp-min-scale-ignored", AMP,
           "return self.overflows >= self.patience or (math.isfinite(scale) and scale < self.min_scale)",
           "return self.overflows >= self.patience",
           "docs/distributed.md: overflows are an incident 'when the scale falls below check.amp_min_scale'"),
    Mutant("amp", "doc-amp-scale-capped-always", SNAPSHOTS,
           'if overflows > 0 and "scale" in state:',
           'if "scale" in state:',
           "docs/distributed.md: a rollback restores the scaler; only 'during a streak of overflows' does the "
           "scale stay at its current, lower value (after a NaN loss the snapshot's scale comes back)"),
    Mutant("amp", "doc-amp-found-inf-overwritten", AMP,
           "t.copy_(torch.maximum(t, skip.to(device=t.device, dtype=t.dtype)))",
           "t.copy_(skip.to(device=t.device, dtype=t.dtype))",
           "docs/distributed.md (16-mixed, lagged): the guard's skip flag 'joins the scaler's found_inf'; here it "
           "replaces it, so a routine overflow with a finite loss is applied with inf gradients"),
    Mutant("amp", "doc-amp-fused-not-unscaled", STEP,
           "        if scaler is not None:\n            ensure_unscaled(scaler, optimizer)",
           "        if scaler is not None:\n            pass",
           "docs/distributed.md: fused optimizers' gradients, 'which Lightning leaves scaled at "
           "on_before_optimizer_step, are unscaled by the guard before it checks or clips them'"),
    # ------------------------------------------------------------------ accumulation, manual optimization, metrics
    Mutant("detection", "doc-accum-input-finding-micro-batch", EVIDENCE,
           "batch = [dict(f, micro_batch=i) for i, (b, _) in enumerate(batches)",
           "batch = [dict(f, micro_batch=0) for i, (b, _) in enumerate(batches)",
           "docs/distributed.md (gradient accumulation): 'input findings name it (details.inputs[i].micro_batch)'"),
    Mutant("detection", "doc-accum-inputs-always-last-only", EVIDENCE,
           "self._input_bad = flag if self._input_bad is None else self._input_bad | flag",
           "self._input_bad = flag",
           "docs/configuration.md check.inputs always: every floating tensor of the batch, every step; with "
           "accumulate_grad_batches only the last micro-batch's inputs count here"),
    Mutant("metrics", "doc-accum-backup-every-micro-batch", CALLBACK,
           "        if self._evidence.micro_batch(batch, batch_idx, trainer.global_step):\n"
           "            self._recovery.step_start(trainer)",
           "        self._evidence.micro_batch(batch, batch_idx, trainer.global_step)\n"
           "        self._recovery.step_start(trainer)",
           "docs/recovery.md (skip_step): the step's buffer and metric writes are undone 'as if the step's "
           "batches never happened, with gradient accumulation ... too'; here only the last micro-batch's"),
    Mutant("detection", "doc-manual-losses-carry-over", EVIDENCE,
           "        if self._read:\n            self._loss_sum = None\n            self._read = False",
           "        if self._read:\n            self._read = False",
           "docs/distributed.md (manual optimization): every optimizer.step() is 'judged by the losses "
           "backpropagated since the previous step'; here the losses of earlier steps keep adding up"),
    Mutant("metrics", "doc-metrics-update-count-kept", METRICS,
           "                metric._update_count = saved.update_count", "                pass",
           "docs/recovery.md: after a skipped step every torchmetrics.Metric is 'as if the step's batches never "
           "happened'; here its update count keeps the skipped update"),
    Mutant("metrics", "doc-metrics-list-states-kept", METRICS,
           "                for attr, items in saved.lists.items():\n"
           "                    setattr(metric, attr, list(items))",
           "                pass",
           "docs/recovery.md: after a skipped step every torchmetrics.Metric is 'as if the step's batches never "
           "happened'; here a list state (CatMetric, AUROC inputs) keeps the skipped batch"),
    # ------------------------------------------------------------------ give up
    Mutant("ladder", "doc-giveup-no-restore", ACTIONS,
           "hands.scaler_overflows) if recovery.store \\\n            else Restored()",
           "hands.scaler_overflows) if recovery.store and recovery.store.newest is None \\\n"
           "            else Restored()",
           "CONTRACT.md / docs/recovery.md: giving up first restores the module's parameters and buffers to the "
           "last known-good state (the newest snapshot)"),
    Mutant("ladder", "doc-giveup-steps-continue", STEP,
           "if p.recovery.stopped or p.recovery.skipping_batches or skip_now:",
           "if p.recovery.skipping_batches or skip_now:",
           "docs/recovery.md: after giving up with on_give_up: stop 'the guard skips any remaining step'"),
    Mutant("ladder", "doc-giveup-snapshot-off-params", LADDER,
           "if self.unconfirmed_rollbacks >= self.cfg.max_rollbacks or not can_roll_back and weights:",
           "if self.unconfirmed_rollbacks >= self.cfg.max_rollbacks:",
           "docs/recovery.md: give up 'when parameters are non-finite and there is no snapshot "
           "(recovery.snapshot: off)'; here training goes on with non-finite weights"),
    # ------------------------------------------------------------------ events, sinks, report CLI
    Mutant("events", "doc-events-scalars-at-read-step", SINKS,
           "self.scalars(scalars, step)",
           "self.scalars(scalars, step + 1)",
           "README / docs/events.md: loggers receive the scalars 'at each event's own step'; here one step "
           "late, at the step that reads a lagged event (the sinks get the event alone since issue 18, not the "
           "trainer whose global_step this mutant used)"),
    Mutant("events", "doc-events-csv-logger-dropped", SINKS,
           "            else:\n                logger.log_metrics(dict(values), step=step)",
           "            else:\n                pass",
           "docs/events.md: 'Every other logger (CSVLogger, W&B, MLflow, ...) gets the scalars through "
           "logger.log_metrics(values, step=...)'"),
    Mutant("events", "doc-events-jsonl-no-fsync", SINKS,
           "                    view = view[os.write(fd, view):]\n                os.fsync(fd)\n            except",
           "                    view = view[os.write(fd, view):]\n            except",
           "README / docs/events.md / configuration.md: events.jsonl lines are 'flushed and fsynced as each "
           "event is recorded'"),
    Mutant("events", "doc-events-reports-key-ignored", RECORDER,
           'if cfg.reports:\n'
           "            sinks.append(ReportSink(self.out_dir, cfg.max_reports))",
           'if True:\n'
           "            sinks.append(ReportSink(self.out_dir, cfg.max_reports))",
           "docs/configuration.md: logging.reports: false writes no incident-NNNN-stepS.txt (a key read but ignored)"),
    Mutant("events", "doc-cli-middle-line-skipped", CLI,
           "                if pending is not None:\n                    raise _bad_line(path, *pending, events)",
           "                if False:\n                    raise _bad_line(path, *pending, events)",
           "CONTRACT.md / docs/events.md: 'a malformed line before the last one ends with exit status 2' (only "
           "a bad last line is skipped with a warning)"),
    Mutant("events", "doc-cli-empty-folder-ok", CLI,
           '    if not files:\n        raise InputError(f"{root}: no {EVENTS_FILE}',
           '    if False:\n        raise InputError(f"{root}: no {EVENTS_FILE}',
           "docs/events.md: 'a folder without any events.jsonl ... ends with exit status 2'"),
    Mutant("events", "doc-cli-deep-json-traceback", CLI,
           "    except RecursionError:\n"
           "        raise ValueError(f\"JSON nested more than {MAX_DEPTH} deep\") from None\n",
           "",
           "docs/events.md: whatever the bytes, exit 0 or 2, never a traceback; here a line of JSON nested 100,000 "
           "deep ends `nanguard report` with a RecursionError"),
    Mutant("events", "doc-cli-imports-torch", PKG + "__init__.py",
           "from .errors import ConfigError, NaNGuardError\n",
           "from .errors import ConfigError, NaNGuardError\nfrom .callback import NaNGuard\n",
           "docs/events.md: `nanguard report` imports neither torch nor Lightning; here every call pays seconds of CPU "
           "for them"),
    # ------------------------------------------------------------------ configuration
    Mutant("config", "doc-config-float-string-refused", CONFIG,
           "        if isinstance(value, str):  # YAML 1.1", "        if False:  # YAML 1.1",
           "docs/configuration.md: '1e-3, which PyYAML reads as a string, is accepted for float keys'"),
    Mutant("config", "doc-config-bool-as-int", CONFIG,
           "        if isinstance(value, int) and not isinstance(value, bool):\n            return value",
           "        if isinstance(value, int):\n            return value",
           "CONTRACT.md / docs/configuration.md: a wrong type raises ConfigError; here true/false pass as int "
           "keys (recovery.max_skips: true)"),
    Mutant("config", "doc-config-activations-zero", CONFIG,
           "if isinstance(self.activations, int) and self.activations < 1:",
           "if isinstance(self.activations, int) and self.activations < 0:",
           "CONTRACT.md / docs/configuration.md: check.activations is 'off', 'on_incident', 'always' or 'int N "
           ">= 1'; here 0 is accepted (and then a modulo by zero at the first step)"),
    Mutant("config", "doc-config-snapshot-dir-ignored", RECOVERY,
           'directory = Path(cfg.snapshot_dir) if cfg.snapshot_dir else out_dir / "snapshots"',
           'directory = out_dir / "snapshots"',
           "docs/configuration.md / recovery.md: disk snapshots go to recovery.snapshot_dir (default "
           "<log_dir>/nanguard/snapshots); here the key is read but ignored"),
    # ------------------------------------------------------------------ issue 34: trust nothing read back
    Mutant("snapshots", "trust-digest-not-compared", VERIFY,
           "    if seal(tensors).digest != expected.digest:", "    if False:",
           "docs/recovery.md: every read checks the tensors' SHA-256 against the seal; here a flipped byte or bit "
           "is restored as good"),
    Mutant("snapshots", "trust-full-unpickler", SNAPSHOTS,
           "weights_only=True, mmap=mmap)", "weights_only=False, mmap=mmap)",
           "docs/recovery.md: snapshot files are read with torch's restricted loader; here a planted pickle runs "
           "its code in the training process"),
    Mutant("snapshots", "trust-swapped-step-accepted", VERIFY,
           '    if meta.get("step") != step:', "    if False:",
           "docs/recovery.md: a file must carry its own step; here an older snapshot's file (same shapes, same "
           "digest as its own seal would say for it) is only caught by the digest"),
    Mutant("snapshots", "trust-refused-stays-in-ring", SNAPSHOTS,
           "        if any(s is snap for s in self.ring):\n            self._evict(snap, keep_file=True)",
           "        if False:\n            self._evict(snap, keep_file=True)",
           "docs/recovery.md: a refused snapshot is never a target again; here it stays in the ring"),
    Mutant("snapshots", "trust-held-copy-first", SNAPSHOTS,
           "return [s for s in kept if not s.in_memory] + [s for s in kept if s.in_memory]", "return kept",
           "docs/recovery.md: a snapshot the disk refused is a target of last resort; here its host copy is "
           "restored before the older snapshot on disk"),
    Mutant("snapshots", "held-copies-pile-up", SNAPSHOTS,
           '            old.failed, old.tensors, old.in_memory = "replaced in memory by a newer snapshot", [], False',
           "            pass",
           "docs/recovery.md, snapshots: only the newest snapshot the disk refused is held in memory; here every "
           "refused one keeps its copy (host memory grows by one state per refusal) and stays a rollback target, "
           "so a rollback whose newest copy is refused restores an older one"),
    Mutant("snapshots", "trust-ranks-do-not-agree", SHARDED,
           "            dist.all_reduce(summed, op=dist.ReduceOp.SUM)  # each rank wrote its own column only",
           "            pass",
           "docs/recovery.md: under DDP every rank refuses a snapshot one rank's share failed; here ranks decide "
           "alone (rank 1 falls back, rank 0 broadcasts from the newest: a mix of two snapshots, or a hang)"),
    Mutant("snapshots", "sharded-large-tensor-not-split", SHARDED,
           "                take = min(size - start, limit - total)",
           "                take = size - start",
           "docs/distributed.md: a sharded rollback splits a tensor larger than the room left in a 16 MiB bucket; "
           "here a tensor goes whole into one broadcast (20 MB for a 5M-float weight: the largest tensor plus a "
           "bucket of extra host memory)"),
    Mutant("snapshots", "sharded-bucket-room-ignored", SHARDED,
           "                take = min(size - start, limit - total)",
           "                take = min(size - start, limit)",
           "docs/distributed.md: a bucket holds at most 16 MiB; here a tensor takes up to 16 MiB on top of what the "
           "bucket already holds (a 12 MB tensor then 12 MB of the next: one 24 MB broadcast)"),
    Mutant("events", "trust-tensorboard-folder-unchecked", SINKS,
           "and \"://\" not in str(folder) and not os.path.isdir(folder):",
           "and False:",
           "docs/recovery.md: the guard writes nothing into a TensorBoard writer whose folder is gone; here its "
           "write kills the writer and Lightning's finalize raises out of fit"),
    Mutant("checkpoint", "trust-empty-state-accepted", STATE_SCHEMA,
           "    if not any(name in out for name in (*DECISIONS, *STATISTICS)):", "    if False:",
           "docs/recovery.md: a guard state holding no section is refused; here every decision resumes from its "
           "default, silently"),
    # ------------------------------------------------------------------ the incident pictures (issue 37)
    Mutant("diagnosis", "flow-divergence-culprit-dropped", RULES,
           "        if ev.culprit is None and cause_entry(cause).runaway_culprit:", "        if False:",
           "issue 37: a divergence names the module that ran away as its culprit; here it names none again"),
    Mutant("diagnosis", "flow-culprit-by-gradients-only", CULPRIT,
           "    found = _by_weights(ctx, onset)\n", "    found = None\n",
           "docs/events.md: a module whose weights run away is the culprit, not the module below it whose gradients "
           "grew faster; here only the gradients count (the measured 4-layer MLP names net.4)"),
    Mutant("events", "flow-ring-row-not-copied", FLOW,
           "        self._rows[slot].copy_(parts)", "        pass",
           "issue 37: each step's per-tensor norms go into the ring; here nothing does (NaN heatmaps)"),
    Mutant("events", "flow-pictures-rolled-back-unmarked", FLOW,
           "        marks = list(self.marks)\n        j = self.column(step)",
           "        marks = list(self.marks.replace('r', 'h'))\n        j = self.column(step)",
           "docs/events.md: the gradient-flow picture shades the steps a rollback undid; here they look healthy"),
    Mutant("events", "flow-pictures-never-drawn", PICTURE_SINK,
           "if self.available and event.flow is not None and", "if False and",
           "issue 37: every event that kept its window is drawn into TensorBoard and as PNG files; here none is"),
    # ------------------------------------------------------------- promises no test pinned (issues 43, 46)
    Mutant("events", "report-json-comma-per-file", CLI,
           "    first = True\n    for f, _, end in scanned:\n",
           "    for f, _, end in scanned:\n        first = True\n",
           "docs/events.md: `nanguard report FOLDER --json` prints one JSON document; here the first event of every "
           "file after the first has no comma before it (invalid JSON over two or more files)"),
    Mutant("events", "numbering-reports-only-without-jsonl", RECORDER,
           "            found = max(found, highest_report(self._reports.directory))",
           "            found = found or highest_report(self._reports.directory)",
           "docs/events.md: a fit numbers after the highest number in events.jsonl or among the report files; here "
           "an events.jsonl that is behind (lines the disk refused) hides the report files: numbers and names reused"),
    Mutant("events", "progress-bar-waits-for-an-incident", PROGRESS,
           "        if incidents == 0 and lr_scale == 1.0:  # healthy so far",
           "        if incidents == 0:  # healthy so far",
           "docs/events.md, progress bar: ng_lr_scale shows from the first incident or LR cut; here an LR cut "
           "without an incident (a reduce_lr spike, three spikes in the window) never reaches the bar"),
    Mutant("events", "folder-beside-checkpoints-by-string-prefix", RECORDER,
           "if Path(os.path.abspath(folder)).is_relative_to(os.path.abspath(d))]",
           "if os.path.abspath(folder).startswith(os.path.abspath(d))]",
           "docs/events.md, where events go: the folder moves beside a checkpoint folder only when it lies inside it; "
           "here ModelCheckpoint(dirpath='runs/a') with default_root_dir='runs/a2' sends it to runs/a-nanguard"),
    Mutant("ladder", "give-up-step-0-restored-as-nothing", ENDINGS,
           "    if restored is not None:\n        state = (", "    if restored:\n        state = (",
           "docs/recovery.md, give up: a give-up that restored the train-start snapshot says 'the snapshot of step 0'; "
           "here step 0 is falsy and the message says nothing could be restored"),
    Mutant("ladder", "give-up-unrestored-weights-not-looked-at", RESPONDER,
           "            bad = [] if response.rolled_back else p.evidence.weights.find(self.fit.module)",
           "            bad = []",
           "docs/recovery.md, give up: a give-up that restored nothing says which weights it leaves non-finite; here "
           "it calls NaN weights 'finite' (and the end of fit records a second event about them)"),
    Mutant("ladder", "give-up-non-finite-said-twice", RESPONDER,
           "            self.left_nonfinite = bool(bad)", "            self.left_nonfinite = False",
           "docs/recovery.md, end of fit: nothing new where the give-up already said the weights are left non-finite; "
           "here the end of fit records a second event about the same weights"),
    Mutant("snapshots", "give-up-failed-writes-not-said", RECOVERY,
           "        failures = self.store.failures\n",
           "        failures = [f for f in self.store.failures if f[\"in_memory\"]]\n",
           "docs/recovery.md, give up: where every snapshot failed to be kept the give-up says 'no snapshot could be "
           "kept: N snapshot write(s) failed (...)'; here only disk refusals count and it says 'no snapshot was "
           "taken yet'"),
    # ------------------------------------------------------------------ a good guest again (issue 43)
    Mutant("events", "guest-pictures-drawn-on-a-thread", PICTURE_SINK,
           "            self.draw(event.to_dict(), event.step if event.log_step is None else event.log_step)",
           "            __import__('threading').Thread(target=self.draw, daemon=True, args=(\n"
           "                event.to_dict(), event.step if event.log_step is None else event.log_step)).start()",
           "issue 43: the guard draws in the training thread, never beside the user's own matplotlib (not "
           "thread-safe); here a drawing thread races it: pictures lost, ParseException in the user's figure"),
    Mutant("snapshots", "guest-write-event-pickled", WRITER,
           '        del state["_done"]\n', "",
           "issue 43: a guard pickles and deep-copies during a fit; here a snapshot's write keeps its lock in the "
           "copy (TypeError: cannot pickle '_thread.lock')"),
    Mutant("snapshots", "guest-writer-thread-pickled", WRITER,
           "        is copied itself).\"\"\"\n        return {}",
           "        is copied itself).\"\"\"\n        return self.__dict__",
           "issue 43: a guard that has run a fit pickles; here the snapshot thread and its queue go into the copy"),
    Mutant("events", "guest-sinks-pickled", RECORDER,
           "        state.update(sinks=[], _scalar_sinks=[], _reports=None, _jsonl=None)\n", "",
           "issue 43: a copy of a guard leaves its fit's sinks behind; here the loggers' writers (threads, locks) "
           "go into the copy and it does not pickle"),
    Mutant("events", "guest-bound-fit-pickled", RESPONDER,
           '        state["_fit"] = None\n', "",
           "issue 43: a copy of a guard is not bound to the fit: here the Trainer, the module and the user's "
           "callbacks are pickled with it"),
    Mutant("detection", "guest-activation-min-dropped", PKG + "detect/activations.py",
           "for end in torch.aminmax(t)]", "for end in torch.aminmax(t)[1:]]",
           "check.activations: a -Inf in a module output raises the step's flag; here only the max is judged"),
    Mutant("detection", "guest-activation-sum-in-own-dtype", PKG + "detect/activations.py",
           "        ends = [end for t in outputs if t.numel() for end in torch.aminmax(t)]",
           "        ends = [t.sum() for t in outputs if t.numel()]",
           "check.activations is exact: huge finite outputs whose sum overflows are no incident; here they are"),
    Mutant("diagnosis", "batch-written-in-place-blamed-on-data", RESPONDER,
           "                inputs = data\n", "                inputs = list(inputs)\n",
           "docs/diagnosis.md, the replay: a NaN a training_step wrote into its own batch in place (x /= x.norm() on a "
           "zero row, batch[0].log_() on a negative) is the step's, not bad data; here it is kind input, cause input"),
    Mutant("diagnosis", "batch-versions-not-taken", EVIDENCE,
           "rng_state() if self.keep_rng else None, batch_versions(batch))",
           "rng_state() if self.keep_rng else None)",
           "docs/diagnosis.md, the replay: the batch tensors' versions, taken when a micro-batch starts, tell a batch "
           "the step wrote into in place; here none is taken and its NaN is blamed on the data"),
    Mutant("diagnosis", "replay-writes-into-the-batch-again", RERUN,
           "    return batch.copy()[0] if isinstance(batch, Rewritten) else batch",
           "    return batch.batch if isinstance(batch, Rewritten) else batch",
           "docs/diagnosis.md, the replay changes nothing of training: a batch the step wrote into in place is "
           "replayed on copies; here every pass writes into the user's batch again"),
    Mutant("diagnosis", "batch-writer-op-not-named", PROBES,
           "        self.written = {t.untyped_storage().data_ptr(): path for path, t in written}",
           "        self.written: dict[int, str] = {}",
           "docs/diagnosis.md, the replay: the in-place op that wrote the NaN into the step's own batch is named (op, "
           "details.batch_written's function and source); here no op is named"),
    Mutant("diagnosis", "written-batch-replay-called-transient", RULES,
           "    if ctx.written:\n        note.note", "    if not ctx.written:\n        note.note",
           "docs/diagnosis.md, cause 4-: a clean replay of a batch the step wrote into in place ran on the values it "
           "wrote, so it is not transient; here it is"),
    Mutant("diagnosis", "written-batch-suggestion-lost", CAUSE_TABLE,
           "    written = _written(d)\n    if written is not None:\n        return written\n", "",
           "docs/diagnosis.md, suggestion: a NaN the step wrote into its batch in place says so and to clone the batch "
           "before writing into it; here the generic advice of unknown"),
    # ------------------------------------------------ issue 46, second half: promises of README.md and docs/*.md
    Mutant("lr", "doc-lr-before-read-after-cut", RECOVERY,
           "details.update(lr_before=before,", "details.update(lr_before=current_lrs(trainer.optimizers),",
           "docs/recovery.md: a cut records details.lr_before, lr_after and lr_scale; here lr_before is read after "
           "the cut (the same LR as lr_after)"),
    Mutant("events", "doc-clip-threshold-scalar-is-the-norm", PARTS,
           'values["clip_threshold"] = float(threshold)', 'values["clip_threshold"] = float(self.clipper.last_norm)',
           "docs/events.md, loggers: nanguard/clip_threshold is the clip limit in force (clip.max_norm); here it "
           "logs the step's gradient norm"),
    Mutant("events", "doc-event-line-batch-is-the-step", EVENTS,
           "(epoch {self.epoch}, batch {self.batch_idx})", "(epoch {self.epoch}, batch {self.step})",
           "docs/events.md, lines on screen: '[nanguard] step 19 (epoch 1, batch 3): ...'; here the batch shown is "
           "the global step"),
    Mutant("config", "doc-unknown-key-allowed-not-listed", CONFIG,
           "msg = f\"{prefix}{key}: unknown key; allowed: {', '.join(known)}\"",
           "msg = f\"{prefix}{key}: unknown key\"",
           "the contract: an unknown key's ConfigError names the key and what is allowed; here a key with no near "
           "match says only 'unknown key' (constructor, YAML, nanguard validate)"),
    Mutant("snapshots", "doc-snapshot-failures-first-named-as-last", SNAPSHOTS,
           "last = self.failures[-1]", "last = self.failures[0]",
           "docs/recovery.md, snapshots: the end of fit says 'N snapshot(s) not written this fit (the last at step "
           "S: ...)'; here it names the first failure's step and error"),
    Mutant("snapshots", "doc-stale-tmp-snapshots-left", SNAPSHOTS,
           '_SNAPSHOT_FILE = re.compile(r"snapshot-step\\d+\\.pt(\\.tmp)?")',
           '_SNAPSHOT_FILE = re.compile(r"snapshot-step\\d+\\.pt")',
           "docs/recovery.md: fit start clears the snapshot-step*.pt and .pt.tmp files an earlier run left; here the "
           ".pt.tmp files of a killed write stay (and the count said is short)"),
    Mutant("events", "doc-report-file-header-counts-all", CLI,
           "out.write(f\"{f}  ({count} incident{'s' if count != 1 else ''})\\n\")",
           "out.write(f\"{f}  ({totals.incidents} incident{'s' if count != 1 else ''})\\n\")",
           "README, nanguard report: each events.jsonl of a folder is headed with its own count; here every header "
           "shows the total over all files"),
    Mutant("events", "doc-report-totals-first-action-only", CLI,
           "for v in (vals if isinstance(vals, list) else [vals]):",
           "for v in (vals[:1] if isinstance(vals, list) else [vals]):",
           "README, nanguard report: the totals count every action of every event (actions: skip_step=5, clip=2, "
           "...); here only each event's first action"),
]
