"""What a resume may change (config/resume.py): the one table, the differences that count
as the user's, and the message that refuses the rest."""

from __future__ import annotations

import copy

import pytest
from helpers import compose_config

from ddpexp.config import resume as rules


@pytest.fixture(scope="module")
def saved() -> dict:
    return compose_config("model=mlp", "model.hidden=[8]")


def changed(config: dict, **values) -> dict:
    config = copy.deepcopy(config)
    for key, value in values.items():
        *parents, last = key.split("__")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        if value is rules.ABSENT:
            node.pop(last)
        else:
            node[last] = value
    return config


@pytest.mark.parametrize("key,verdict", [
    ("optimizer.lr", rules.APPLY), ("optimizer.betas", rules.APPLY),
    ("optimizer._target_", rules.REFUSE), ("scheduler.min_lr", rules.APPLY),
    ("scheduler._target_", rules.REFUSE), ("trainer.max_epochs", rules.APPLY),
    ("trainer.procs", rules.APPLY), ("trainer.strategy", rules.APPLY), ("trainer.gpus", rules.APPLY),
    ("trainer.monitor", rules.REFUSE), ("callbacks.ema.decay", rules.APPLY),
    ("logger.tensorboard.flush_secs", rules.APPLY), ("data.batch_size", rules.APPLY),
    ("data.num_workers", rules.APPLY), ("data.shape", rules.REFUSE), ("data._target_", rules.REFUSE),
    ("data.split_seed", rules.REFUSE), ("model.hidden", rules.REFUSE), ("task.metrics", rules.REFUSE),
    ("seed", rules.REFUSE), ("resume", rules.IGNORE), ("mine.k", rules.REFUSE),
])
def test_each_key_has_one_verdict(key, verdict):
    assert rules.rule(key)[0] == verdict


def test_the_same_config_changes_nothing(saved):
    assert rules.changes(saved, copy.deepcopy(saved)) == []


def test_changes_are_found_in_key_order(saved):
    new = changed(saved, optimizer__lr=0.5, model__hidden=[16], trainer__max_epochs=3, resume="x")
    assert [(c.key, c.before, c.after) for c in rules.changes(saved, new)] == [
        ("model.hidden", [8], [16]), ("optimizer.lr", 0.05, 0.5), ("trainer.max_epochs", 10, 3)]


def test_a_key_the_checkpoint_lacks_is_no_change_but_a_new_callback_is(saved):
    old = changed(saved, trainer__ema_decay=rules.ABSENT)  # an earlier version's config
    new = changed(saved, callbacks__probe={"_target_": "mypkg.Probe"})
    found = rules.changes(old, new)
    assert [(c.key, c.before) for c in found] == [("callbacks.probe", rules.ABSENT)]
    assert found[0].verdict == rules.APPLY


def test_a_value_the_data_fills_in_is_no_change(saved):
    old = changed(saved, model__num_classes=3)
    assert rules.changes(old, changed(saved, model__num_classes=None)) == []


def test_a_default_this_version_changed_is_no_change(saved):
    old = changed(saved, callbacks__lr_monitor__every_n_steps=1)  # 0.1.0's default
    new = changed(saved, trainer__max_epochs=4)
    baseline = copy.deepcopy(saved)  # this version's config of the run's own overrides
    assert [c.key for c in rules.changes(old, new, baseline)] == ["trainer.max_epochs"]
    assert [c.key for c in rules.changes(old, new)] == [
        "callbacks.lr_monitor.every_n_steps", "trainer.max_epochs"]


def test_a_schedule_added_to_a_run_without_one_is_refused(saved):
    new = changed(saved, scheduler={"_target_": "ddpexp.schedulers.cosine", "_partial_": True})
    found = rules.changes(saved, new)
    assert "scheduler._target_" in [c.key for c in found]
    assert "scheduler._target_: (none) in the checkpoint" in rules.refusal(found, "run")


def test_the_refusal_names_each_key_both_values_and_the_fix(saved):
    new = changed(saved, model__hidden=[16], seed=3, optimizer__lr=0.5)
    text = rules.refusal(rules.changes(saved, new), "outputs/run")
    assert text.startswith("resume=outputs/run cannot change what the checkpoint was trained with")
    assert "  model.hidden: [8] in the checkpoint, [16] now (the checkpoint's weights" in text
    assert "  seed: 0 in the checkpoint, 3 now (it reorders the data" in text
    assert "optimizer.lr" not in text
    assert "Resume with the checkpoint's values (model.hidden=[8] seed=0)" in text
    assert rules.refusal(rules.changes(saved, changed(saved, optimizer__lr=0.5)), "x") is None


def test_value_at_and_shown():
    assert rules.value_at({"a": {"b": 1}}, "a.b") == 1
    assert rules.value_at({"a": {"b": 1}}, "a.c") == rules.ABSENT
    assert [rules.shown(v) for v in (0.5, [16], "ddp", None, True)] == ["0.5", "[16]", "ddp", "null", "true"]
