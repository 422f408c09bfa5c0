"""The accuracy study's own logic, fast: the language model's data split and shapes, and the
verdicts and rule that docs/accuracy.md states, on synthetic results with known answers."""
from __future__ import annotations

import math
import subprocess

import numpy as np
import pytest
import torch

from benchmarks import accuracy_doc as doc
from benchmarks import accuracy_lm as lm
from benchmarks.accuracy import BY_KEY, TASKS, configs_for, lr_factor

# ------------------------------------------------------------------------------- language model


def test_split_is_deterministic_disjoint_and_covers_the_text():
    from pydoc_data.topics import topics

    train, val = lm.lm_data()
    again_train, again_val = lm.lm_data()
    assert np.array_equal(train, again_train) and np.array_equal(val, again_val)
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    assert len(train) + len(val) == len(text)
    # every HOLD_OUT-th block is validation, in order: rebuild the text from the two parts
    blocks, t, v = [], 0, 0
    for i in range(0, len(text), lm.BLOCK):
        size = min(lm.BLOCK, len(text) - i)
        if (i // lm.BLOCK) % lm.HOLD_OUT == lm.HOLD_OUT - 1:
            blocks.append(val[v:v + size]); v += size
        else:
            blocks.append(train[t:t + size]); t += size
    assert bytes(np.concatenate(blocks)) == text
    assert 0.03 < len(val) / len(text) < 0.05  # 1 block in 25


def test_windows_are_next_byte_targets():
    data = np.arange(200, dtype=np.uint8)
    x, y = lm.val_windows(data, context=16)
    assert x.shape == y.shape == (12, 16) and x.dtype == torch.int64
    assert torch.equal(y, x + 1) and torch.equal(x[1, 0], torch.tensor(16))
    xb, yb = lm.train_batch(data, 5, torch.Generator().manual_seed(0), context=16)
    assert xb.shape == yb.shape == (5, 16) and torch.equal(yb, xb + 1)


def test_cosine_schedule_warms_up_linearly_then_decays_to_zero():
    total = 100  # warm-up: the first 10 steps
    factors = [lr_factor("cosine", s, total) for s in range(total)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[10] == 1.0 and 0 < factors[-1] < 1e-3  # reaches 0 one step after the last
    assert factors[55] == pytest.approx(0.5)  # half way through the decay (approx: float rounding)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))
    assert {lr_factor("constant", s, total) for s in range(total)} == {1.0}
    with pytest.raises(ValueError, match="unknown schedule 'linear'"):
        lr_factor("linear", 0, total)


def test_model_shapes_and_causality():
    model = lm.TinyTransformer(seed=0, context=16)
    tokens = torch.randint(0, 256, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, lm.VOCAB)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    later = model(changed)
    # a byte changes only the predictions at and after its position (atol: float rounding)
    assert torch.allclose(logits[:, :10], later[:, :10], atol=1e-5)
    assert not torch.allclose(logits[:, 10:], later[:, 10:], atol=1e-3)
    assert torch.equal(lm.TinyTransformer(seed=0, context=16)(tokens), logits)  # seed fixes the weights


def test_untrained_model_is_near_uniform():
    _, val = lm.lm_data()
    loss = lm.val_loss(lm.TinyTransformer(seed=0), lm.val_windows(val[:5000]))
    assert abs(loss - math.log(lm.VOCAB)) < 0.5


def test_configs_follow_the_optimizer():
    assert "w2-adam-int8" in configs_for(TASKS["pydoc-lm"], None)
    assert all(BY_KEY[k].correction != "adam_prediction" for k in configs_for(TASKS["shapes"], None))
    assert configs_for(TASKS["digits"], ["sync", "w2-adam", "w2-dc-int8"]) == ["sync", "w2-dc-int8"]
    assert configs_for(TASKS["pydoc-lm"], ["sync", "w2-adam"]) == ["sync", "w2-adam"]


# ------------------------------------------------------------------------ verdicts and the rule

def _result(task, metric, optimizer, finals, seeds=3):
    """A result with the given final value per configuration (accuracy fraction or loss), the
    seeds spread around it by -d, 0, +d so the mean is the value."""
    runs = []
    for key, value in finals.items():
        for s in range(seeds):
            v = value + (s - 1) * 1e-3
            runs.append({"config": key, "seed": s, "value": [v * 0.5, v], "spread": [0.0, 0.0],
                         "time": [1.0, 2.0], "loss": [1.0, 0.5], "wire_ratio": 1.0})
    return {"task": task, "metric": metric, "optimizer": optimizer, "lr": 0.01, "momentum": 0.9,
            "weight_decay": 0.01, "epochs": 2, "batch": 32, "ranks": 2, "steps_per_epoch": 10,
            "train_size": 100, "test_size": 50, "runs": runs}


def _synthetic():
    sgd = [
        _result("digits", "accuracy", "sgd", {"sync": 0.98, "w2": 0.95, "w2-int8": 0.95, "w2-wp-int8": 0.978,
                                              "w2-dc-int8": 0.960, "w2-eager-int8": 0.979}),
        _result("shapes", "accuracy", "sgd", {"sync": 0.90, "w2": 0.80, "w2-int8": 0.80, "w2-wp-int8": 0.885,
                                              "w2-dc-int8": 0.85, "w2-eager-int8": 0.897}),
    ]
    loss_sync = 1.5  # perplexity e^1.5; the others' losses give known perplexity ratios
    lmr = _result("pydoc-lm", "val_loss", "adamw",
                  {"sync": loss_sync, "w2": loss_sync + math.log(1.10), "w2-wp-int8": loss_sync + math.log(1.02),
                   "w2-adam-int8": loss_sync + math.log(1.005), "w2-eager-int8": loss_sync + math.log(1.03),
                   "w2-adam": loss_sync + math.log(0.99)})  # better than all, but not int8+EF: no candidate
    return sgd + [lmr]


def test_shortfall_units():
    digits, shapes, lmr = _synthetic()
    assert doc.shortfall(digits, "w2-wp-int8") == pytest.approx(0.2)   # points below sync
    assert doc.shortfall(shapes, "w2-eager-int8") == pytest.approx(0.3)
    assert doc.shortfall(lmr, "w2-adam-int8") == pytest.approx(0.5, rel=1e-6)  # % perplexity above sync
    assert doc.shortfall(lmr, "w2") == pytest.approx(10.0, rel=1e-6)
    assert doc.finals(lmr, "sync")[1] == pytest.approx(math.exp(loss_sync := 1.5))


def test_verdicts_pick_the_best_correction_with_int8():
    digits, shapes, lmr = _synthetic()
    v = doc.verdict(digits, BY_KEY)
    assert (v["best"], v["met"]) == ("eager", True) and v["gap"] == pytest.approx(0.1)
    assert v["plain"] == pytest.approx(3.0)
    v = doc.verdict(lmr, BY_KEY)
    assert v["best"] == "adam_prediction" and v["met"] and v["target"] == 1.0
    # w2 (no int8) and corrections without int8 are not candidates
    assert set(v["gaps"]) == {"weight_prediction", "adam_prediction", "eager"}
    missed = _result("x", "val_loss", "adamw", {"sync": 1.0, "w2-wp-int8": 1.0 + math.log(1.015)})
    assert not doc.verdict(missed, BY_KEY)["met"]


def test_rule_ranks_by_worst_shortfall_in_target_units():
    verdicts = [doc.verdict(r, BY_KEY) for r in _synthetic()]
    entries = {e["optimizer"]: e for e in doc.rule(verdicts)}
    sgd = entries["sgd"]["ranked"]
    # eager: worst 0.3 points (shapes); weight prediction: 1.5 (shapes); delay compensation: 5.0
    assert [r["correction"] for r in sgd] == ["eager", "weight_prediction", "delay_compensation"]
    assert sgd[0]["worst"] == pytest.approx(0.6) and sgd[0]["worst_task"] == "shapes" and sgd[0]["met"] == 2
    assert sgd[1]["met"] == 1 and sgd[2]["met"] == 0
    adamw = entries["adamw"]["ranked"]
    assert [r["correction"] for r in adamw] == ["adam_prediction", "weight_prediction", "eager"]
    assert adamw[0]["worst"] == pytest.approx(0.5, rel=1e-6)
    text = doc.rule_text(verdicts)
    assert 'SGD with momentum** (digits, shapes): `staleness_correction="eager"`: within target on 2 of 2' in text
    assert 'AdamW** (pydoc-lm): `staleness_correction="adam_prediction"`' in text
    assert "differs by optimizer" in text


def test_rule_skips_a_correction_missing_on_some_task():
    digits, shapes, _ = _synthetic()
    shapes["runs"] = [r for r in shapes["runs"] if r["config"] != "w2-eager-int8"]
    entries = doc.rule([doc.verdict(r, BY_KEY) for r in (digits, shapes)])
    assert [r["correction"] for r in entries[0]["ranked"]] == ["weight_prediction", "delay_compensation"]


def test_document_states_the_computed_verdicts_and_keeps_the_marked_section(tmp_path):
    results = _synthetic()
    kept_doc = tmp_path / "accuracy.md"
    kept_doc.write_text("old text\n<!-- BEGIN corrections -->\n## Staleness corrections\nkept 1.23\n"
                        "<!-- END corrections -->\nold tail\n<!-- BEGIN lm-delay -->\nkept 4.56\n<!-- END lm-delay -->\n")
    tasks = {**TASKS, "x": TASKS["digits"]}
    cost = {"step_ms": 1.0, "step_corrected_ms": 1.5, "pair_ms": 0.1, "params": 10, "extra_bytes": 80}
    doc.write(results, cost, 12.0, "a machine", BY_KEY, tasks, doc=kept_doc, image=tmp_path / "a.png")
    text = kept_doc.read_text()
    assert (tmp_path / "a.png").stat().st_size > 0
    assert ("<!-- BEGIN corrections -->\n## Staleness corrections\nkept 1.23\n<!-- END corrections -->\n\n"
            "<!-- BEGIN lm-delay -->\nkept 4.56\n<!-- END lm-delay -->") in text
    assert "old text" not in text and "old tail" not in text
    assert "- **digits** (SGD with momentum): best `eager`, -0.10 points (within 0.5 point)" in text
    assert "- **pydoc-lm** (AdamW): best `adam_prediction`, +0.50% perplexity (within 1% perplexity)" in text
    assert "Met on every task" in text
    assert "| width 2 | 95.00 ± 0.10 | -3.00 |" in text
    assert "| width 2 | 1.5953 ± 0.0010 | 4.930 ± 0.005 | +10.00% |" in text


def test_previous_figures_match_the_previous_doc():
    """The quoted figures of the previous run are those of docs/accuracy.md at that commit."""
    try:
        old = subprocess.run(["git", "show", f"{doc.PREVIOUS_COMMIT}:docs/accuracy.md"], capture_output=True,
                             text=True, check=True, cwd=doc.ROOT).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history here")
    for task, (alone, warm, m08) in doc.PREVIOUS.items():
        section = old.split(f"### `{task}`:")[1].split("###")[0]
        for label, gap in (("width 2 + correction, int8+EF |", alone), ("first epoch synchronous |", warm),
                           ("momentum x 0.8 |", m08)):
            row = next(line for line in section.splitlines() if label in line)
            assert float(row.split("|")[3]) == pytest.approx(gap), (task, label)


# ------------------------------------------------------- plain delayed AdamW (accuracy_lm_delay)


def test_plain_delayed_adamw_reference_is_synchronous_until_the_delay_starts_then_differs():
    from benchmarks import accuracy_lm_delay as delay

    short = delay.Setting("short", 1e-2, steps=8)
    sync = delay.train(short, delayed=False)
    assert len(sync) == delay.EVALS and all(math.isfinite(v) for v in sync)
    # synchronous throughout (the delay would start after the last step): the synchronous run, bitwise
    assert delay.train(delay.Setting("late", 1e-2, steps=8, sync_first=8), delayed=True) == sync
    delayed = delay.train(short, delayed=True)
    assert delayed != sync
    # the first two steps synchronous: equal at the first evaluation (after step 2), different from the next on
    half = delay.train(delay.Setting("half", 1e-2, steps=8, sync_first=2), delayed=True)
    assert half[0] == sync[0] and half[1:] != sync[1:]


def test_plain_delayed_adamw_section_reports_the_end_gap():
    from benchmarks import accuracy_lm_delay as delay

    s = delay.Setting("a setting", 1e-2, steps=400)
    text = delay.section({s: {False: [10.0, 8.0, 6.0, 5.0], True: [12.0, 11.0, 10.0, 7.5]}}, 61.0)
    assert "| a setting | 100 / 200 / 300 / 400 | 10.00 / 8.00 / 6.00 / 5.00 | 12.00 / 11.00 / 10.00 / 7.50 " \
           "| +50.0% |" in text


def test_settings_name_a_trials_schedule_and_only_then():
    _, _, lmr = _synthetic()
    assert "schedule" not in doc._settings(lmr)
    assert doc._settings({**lmr, "schedule": "cosine"}).endswith(", learning rate schedule: cosine (warm-up, then decay)")
