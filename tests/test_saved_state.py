"""The guard state saved in a checkpoint is checked on resume: a malformed decision (counts, numbering, LR scale,
ladder, faults per rank), a future version or an older one (from before 0.1.0) ends the resume with a NaNGuardError
naming the key; malformed running statistics are reset with one warning and the resumed fit still rescues; a cut LR
without its ``recovery.lr_scale`` is reconciled from the optimizer.

One real fit per module writes the checkpoint (an LR cut at step 6, warmed-up statistics); each case edits a copy
(``torch.load``, change the guard's state, ``torch.save``) and resumes a real Trainer from it with ``ckpt_path``."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import pytorch_lightning as pl
import torch

from lightning_nanguard import NaNGuard, NaNGuardError
from lightning_nanguard.state_schema import check_state, known_keys
from lightning_nanguard.testing import Fault, FaultInjector
from . import models

pytestmark = pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")

DATA = models.classification_data(n=256)
SAVED_AT, LR = 24, 1e-2


def guard() -> NaNGuard:
    return NaNGuard(logging={"verbose": False, "reports": False}, recovery={"reduce_lr_after": 2})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(path, checkpoint)``: a real fit of SAVED_AT steps (a cosine schedule; two poisoned activations in a row
    at 5 and 6 cut the LR once), saved with ``trainer.save_checkpoint``."""
    root = tmp_path_factory.mktemp("saved")
    first = guard()
    pl.seed_everything(0, verbose=False)
    trainer = models.trainer(root, [FaultInjector([Fault("activation", steps=[5, 6])]), first], max_steps=SAVED_AT,
                             max_epochs=-1)
    trainer.fit(models.Classifier(lr=LR, scheduler="cosine"), models.loader(DATA, 32, shuffle=True))
    assert first.lr_scale == 0.5 and [e.step for e in first.events] == [5, 6]
    path = root / "saved.ckpt"
    trainer.save_checkpoint(path)
    return path, torch.load(path, weights_only=False)


def edited(saved, tmp_path, change) -> str:
    """A copy of the saved checkpoint whose guard state ``change(callbacks)`` edited."""
    ckpt = copy.deepcopy(saved[1])
    change(ckpt["callbacks"])
    path = tmp_path / "edited.ckpt"
    torch.save(ckpt, path)
    return str(path)


def resume(tmp_path, ckpt_path, steps: int = SAVED_AT + 12, faults=()) -> tuple[NaNGuard, pl.Trainer, list[str]]:
    """A new guard, model and Trainer resumed from ``ckpt_path``; the guard's warnings."""
    g = guard()
    pl.seed_everything(0, verbose=False)
    trainer = models.trainer(tmp_path / "resumed", [FaultInjector(list(faults)), g], max_steps=steps, max_epochs=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(models.Classifier(lr=LR, scheduler="cosine"), models.loader(DATA, 32, shuffle=True),
                    ckpt_path=ckpt_path)
    return g, trainer, [str(w.message) for w in caught if str(w.message).startswith("[nanguard]")]


def state(callbacks):
    return callbacks["NaNGuard"]


def put(*keys, value):
    """``change``: set ``state[keys[0]]...[keys[-1]] = value``."""
    def change(callbacks):
        d = state(callbacks)
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return change


# ---------------------------------------------------------------------------------- decisions: NaNGuardError


@pytest.mark.parametrize("change, named", [
    (lambda c: c.__setitem__("NaNGuard", [1, 2]), "got [1, 2] (a list); expected a mapping of sections"),
    (put("counters", "incidents", value="four"), "counters.incidents: got 'four' (a str); expected an integer >= 0"),
    (put("counters", "rollbacks", value=math.nan), "counters.rollbacks: got nan; expected an integer >= 0"),
    (put("counters", "lr_cuts", value=-1), "counters.lr_cuts: got -1"),
    (put("recorder", "index", value=2.5), "recorder.index: got 2.5"),
    (put("recovery", "lr_scale", value=[0.5]), "recovery.lr_scale: got [0.5] (a list); expected a finite number"),
    (put("recovery", "lr_scale", value=math.nan), "recovery.lr_scale: got nan"),
    (put("recovery", "lr_scale", value=0.0), "recovery.lr_scale: got 0.0; expected a finite number in (0.0, 1.0]"),
    (put("recovery", "lr_scale", value=2.0), "recovery.lr_scale: got 2.0"),
    (put("recovery", "ladder", value="abc"), "recovery.ladder: got 'abc' (a str); expected a mapping"),
    (put("recovery", "ladder", "failed_rollbacks", value=True), "recovery.ladder.failed_rollbacks: got True"),
    (put("recovery", "ladder", "recent", value=[3, "x"]), "recovery.ladder.recent[1]: got 'x'"),
    (put("recovery", "ladder", "sized_cut", value="no"), "recovery.ladder.sized_cut: got 'no' (a str); expected "
                                                         "true or false"),
    (put("recovery", "ladder", "episode_cause", value="bad_luck"), "recovery.ladder.episode_cause: got 'bad_luck' "
                                                                   "(a str); expected a cause, one of input, "),
    (put("recovery", "ladder", "episode_last", value=-3), "recovery.ladder.episode_last: got -3"),
    (put("recovery", "lr_cut_step", value="6"), "recovery.lr_cut_step: got '6'"),
    (put("recovery", "hardware", "faults", value={"one": [3]}), "recovery.hardware.faults['one']"),
    (put("recovery", "hardware", "faults", value={"1": 3}), "recovery.hardware.faults['1']: got 3"),
    (put("clipper", "armed", value=1), "clipper.armed: got 1; expected true or false"),
    (put("overflow", value=[0]), "overflow: got [0] (a list); expected a mapping"),
    (put("version", value=99), "version: got 99; this lightning_nanguard reads version 3 only (the checkpoint was "
                               "written by a newer release)"),
    (put("version", value="3"), "version: got '3' (a str); expected the integer 3"),
    (put("version", value=0), "version: got 0; expected the integer 3"),
    (put("recorder", value=None), "recorder: got None"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_malformed_decision_in_a_checkpoint_ends_the_resume_naming_the_key(saved, tmp_path, change, named):
    path = edited(saved, tmp_path, change)
    with pytest.raises(NaNGuardError) as info:
        resume(tmp_path, path)
    message = str(info.value)
    assert message.startswith("NaNGuard cannot resume from the guard state saved in the checkpoint "
                              "(checkpoint['callbacks']['NaNGuard'])") and named in message, message
    assert "delete checkpoint['callbacks']['NaNGuard']" in message  # and how to go on


# ------------------------------------------------------------------------------ statistics: reset, one warning


FAULT = SAVED_AT + 6


@pytest.fixture(scope="module")
def control(saved, tmp_path_factory):
    """What the resumed fit does about the fault at FAULT from the untouched checkpoint: (step, kind, actions,
    cause) of its events."""
    g, _, said = resume(tmp_path_factory.mktemp("control"), str(saved[0]), faults=[Fault("activation", steps=[FAULT])])
    assert said == []
    return [(e.step, e.kind, e.actions, e.cause) for e in g.events]


def _drop_recent_of_spikes(callbacks):
    state(callbacks)["losses"]["spikes"]["recent"] = "soon"


@pytest.mark.parametrize("change, reset", [
    (put("clipper", "history", value="abc"), "clipper.history: got 'abc' (a str); expected a list"),
    (put("clipper", "zclip", "mean", value=math.nan), "clipper.zclip.mean: got nan; expected a finite number"),
    (put("clipper", "zclip", "var", value=-1.0), "clipper.zclip.var: got -1.0"),
    (_drop_recent_of_spikes, "losses.spikes.recent: got 'soon'"),
    (put("losses", "history", value=[0.5, math.inf]), "losses.history[1]: got inf"),
    (put("divergence", "first_loss", value=math.nan), "divergence.first_loss: got nan"),
    (put("divergence", value=["x"]), "divergence: got ['x'] (a list); expected a mapping"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_malformed_statistics_are_reset_with_one_warning_and_the_resumed_fit_still_rescues(saved, control, tmp_path,
                                                                                            change, reset):
    g, trainer, said = resume(tmp_path, edited(saved, tmp_path, change), faults=[Fault("activation", steps=[FAULT])])
    (warning,) = [w for w in said if "running statistics" in w]
    assert reset in warning and "reset to a fresh warm-up" in warning, warning
    # the fit went on to its end, the fault was rescued as from the untouched checkpoint, counts and numbering go on
    assert trainer.global_step == SAVED_AT + 12
    assert [(e.step, e.kind, e.actions, e.cause) for e in g.events] == control and control[0][0] == FAULT
    assert [e.index for e in g.events] == [3] and "skip_step" in control[0][2]
    assert g.counters["incidents"] == 3 and g.lr_scale == 0.5
    assert models.all_finite(trainer.lightning_module)


def test_a_clip_history_that_is_a_string_no_longer_crashes_the_first_incident_after_resume(saved, tmp_path):
    """Today's worst case: a string history loaded silently (extended char by char) and the diagnosis of the first
    incident after resume failed on it. Reset, the incident is diagnosed like any other."""
    g, trainer, said = resume(tmp_path, edited(saved, tmp_path, put("clipper", "history", value="0.5")),
                              steps=SAVED_AT + 2, faults=[Fault("activation", steps=[SAVED_AT])])
    assert len(said) == 1 and "clipper.history" in said[0]
    assert [(e.step, e.actions, e.culprit) for e in g.events] == [(SAVED_AT, ["skip_step"], "net.0")]
    assert g.counters["replays"] == 3  # its replay ran (the two before the checkpoint, and this one)
    assert list(g._clipper.history) and all(isinstance(v, float) for v in g._clipper.history)


# ------------------------------------------------------------------------- a cut LR without recovery.lr_scale


def test_a_cut_lr_without_its_lr_scale_is_reconciled_from_the_optimizer(saved, tmp_path):
    """No ``recovery`` section: the checkpoint's optimizer runs at half the configured LR (its cosine schedule's
    ``initial_lr`` says so, whatever the schedule did to ``lr``). The guard takes 0.5 as its scale, says so, and
    the next cut goes from there: scale and optimizer agree."""
    path = edited(saved, tmp_path, lambda c: state(c).pop("recovery"))
    faults = [Fault("activation", steps=[SAVED_AT + 2, SAVED_AT + 3])]  # two in a row: reduce_lr_after=2
    g, trainer, said = resume(tmp_path, path, faults=faults)
    (warning,) = said
    assert "no recovery.lr_scale" in warning and "0.5 x the configured learning rate" in warning, warning
    assert [e.actions for e in g.events][-1][-1] == "reduce_lr" and g.lr_scale == 0.25
    group = trainer.optimizers[0].param_groups[0]
    assert group["initial_lr"] == pytest.approx(LR * g.lr_scale)  # what the guard says is what the optimizer runs


def test_an_lr_scale_that_is_saved_needs_no_reconciling(saved, tmp_path):
    g, _, said = resume(tmp_path, str(saved[0]), steps=SAVED_AT + 1)
    assert said == [] and g.lr_scale == 0.5 and g.counters["incidents"] == 2


# ------------------------------------------------------------------------------------------ the schema itself


def test_every_key_a_guard_saves_is_checked_and_a_real_state_passes_unchanged(saved):
    """A key a part of the guard saves but the schema does not know would load unchecked: every one is known,
    and the state of a real fit (an LR cut, warmed-up statistics) passes as it is, nothing reset."""
    real = saved[1]["callbacks"]["NaNGuard"]
    checked = check_state(real)
    assert checked.reset == [] and checked.state == real

    def leaves(d, path=""):
        for k, v in d.items():
            key = f"{path}.{k}" if path else k
            yield key
            if isinstance(v, dict) and key not in ("recovery.hardware.faults",):
                yield from leaves(v, key)

    assert set(leaves(real)) - {"version"} <= known_keys()
    fresh = NaNGuard().state_dict()  # and the state of a guard before any fit (NaN norms, -inf maxima)
    assert check_state(fresh).reset == [] and set(leaves(fresh)) - {"version"} <= known_keys()


# --------------------------------------------------------------------- the layouts of the builds before 0.1.0


def as_version_2(callbacks):
    """``change``: the saved state in the version-2 layout (a development build before 0.1.0):
    counts kept by the parts that counted them, adaptive clipping armed in the ladder."""
    v3 = state(callbacks)
    counts, recovery, clipper = v3["counters"], dict(v3["recovery"]), dict(v3["clipper"])
    recovery.update({k: counts[k] for k in ("skipped_steps", "rollbacks", "lr_cuts", "snapshots")},
                    ladder={**recovery["ladder"], "adaptive_clip": clipper.pop("armed")})
    callbacks["NaNGuard"] = {
        **{k: v for k, v in v3.items() if k != "counters"}, "version": 2,
        "recorder": {**v3["recorder"], "incidents": counts["incidents"], "spikes": counts["spikes"]},
        "recovery": recovery, "clipper": {**clipper, "clipped_steps": counts["clipped_steps"]},
        "diagnoser": {"replays": counts["replays"]}}


def as_version_1(callbacks):
    """``change``: the saved state in the version-1 layout (the first development build): one flat
    dict of counters and statistics, no ``version`` key."""
    v3 = state(callbacks)
    callbacks["NaNGuard"] = {
        "counters": dict(v3["counters"]), "event_index": v3["recorder"]["index"],
        "lr_scale": v3["recovery"]["lr_scale"], "ladder": v3["recovery"]["ladder"],
        "healthy_since_snapshot": v3["recovery"]["healthy_since_snapshot"], "norm_ema": v3["clipper"]["zclip"],
        "norm_history": v3["clipper"]["history"], "loss_stats": v3["losses"]["spikes"],
        "loss_history": v3["losses"]["history"], "scaler_overflows": v3["overflow"]["overflows"]}


@pytest.mark.parametrize("change, named", [
    (as_version_2, "version: got 2; this lightning_nanguard reads version 3 only (version 2 is a development "
                   "build's layout from before 0.1.0, and is not read)"),
    (lambda c: c.__setitem__("NaNGuard", {"version": 2, "recorder": [1, 2, 3]}),  # not even a readable version 2
     "version: got 2; this lightning_nanguard reads version 3 only"),
    (put("version", value=1), "version: got 1; this lightning_nanguard reads version 3 only (version 1 is a "
                              "development build's layout from before 0.1.0"),
    (as_version_1, "version: absent (version 1, a development build's layout from before 0.1.0); this "
                   "lightning_nanguard reads version 3 only"),
], ids=["version-2", "version-2-malformed", "version-1-numbered", "version-1"])
def test_a_state_of_a_pre_release_version_ends_the_resume_saying_so(saved, tmp_path, change, named):
    """Versions 1 and 2 were the layouts of development builds: they are not upgraded (there is no released
    checkpoint to upgrade), and a resume from one ends before training with a NaNGuardError naming ``version``,
    what was found, what is read and how to go on, never with an error from inside a part of the guard."""
    with pytest.raises(NaNGuardError) as info:
        resume(tmp_path, edited(saved, tmp_path, change))
    message = str(info.value)
    assert message.startswith("NaNGuard cannot resume from the guard state saved in the checkpoint "
                              "(checkpoint['callbacks']['NaNGuard'])") and named in message, message
    assert message.endswith("To go on: resume from another checkpoint, or delete checkpoint['callbacks']['NaNGuard'] "
                            "from this one to resume with a fresh guard state (counters, event numbering and LR "
                            "scale start over)."), message


def test_deleting_a_pre_release_state_resumes_the_fit_with_a_fresh_guard_state(saved, tmp_path):
    """What the message says to do works: without its guard state the checkpoint resumes (weights, optimizer and
    schedule from the checkpoint) and the guard starts over, as the message says (counters, LR scale)."""
    g, trainer, said = resume(tmp_path, edited(saved, tmp_path, lambda c: c.pop("NaNGuard")), steps=SAVED_AT + 2)
    assert trainer.global_step == SAVED_AT + 2 and said == []
    assert g.events == [] and g.counters["incidents"] == 0 and g.lr_scale == 1.0


def test_common_ratio_is_one_fraction_of_every_group_or_none():
    from lightning_nanguard.recover.lr import common_ratio

    assert common_ratio([0.1, 0.01], [0.05, 0.005]) == pytest.approx(0.5)
    assert common_ratio([0.1, 0.01], [0.05, 0.01]) is None  # the groups disagree: not the guard's one cut
    assert common_ratio([0.1], [0.05, 0.01]) is None and common_ratio([], []) is None
    assert common_ratio([0.0], [0.0]) is None and common_ratio([0.1], [math.nan]) is None
