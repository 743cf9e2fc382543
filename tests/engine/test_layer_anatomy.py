"""bench.layer_anatomy: a traced decode step's kernels by their place in the layer pattern."""

from __future__ import annotations

from kvfleet_engine.bench.layer_anatomy import patterns, report

LAYER = [("norm", 2.0), ("qkv", 10.0), ("attn", 4.0), ("o", 6.0), ("norm", 2.0), ("mlp", 30.0)]


def _step(t: float, layers: int, gap: float) -> tuple[list[tuple[float, float, str]], float]:
    """One step: the embedding, `layers` layers, lm_head; each kernel `gap` µs after the last."""
    spans = []
    for name, micros in [("embed", 1.0)] + LAYER * layers + [("lm_head", 50.0)]:
        t += gap
        spans.append((t, t + micros, name))
        t += micros
    return spans, t


def test_each_position_of_the_layer_gets_its_mean_time_and_gap_and_the_rest_is_apart() -> None:
    spans, t = _step(0.0, 4, 1.0)
    more, _ = _step(t, 4, 1.0)
    found, loose = patterns(spans + more)
    attention_half, mlp_half = sorted(found, key=lambda p: len(p.names), reverse=True)
    assert attention_half.names == ("norm", "qkv", "attn", "o") and attention_half.count == 8
    assert [d / attention_half.count for d in attention_half.durations] == [2.0, 10.0, 4.0, 6.0]
    assert [g / attention_half.count for g in attention_half.gaps] == [1.0, 1.0, 1.0, 1.0]
    # the last layer's MLP half runs on into lm_head: that cut is not the pattern, so it is apart
    assert mlp_half.names == ("norm", "mlp") and mlp_half.count == 6
    assert loose == 2 * (1.0 + 2.0 + 30.0 + 50.0)


def test_overlapping_kernels_show_a_negative_gap_and_the_report_is_per_step() -> None:
    spans, _ = _step(0.0, 3, -0.5)  # each kernel starts 0.5 µs before the last one ends (PDL)
    lines = report(spans, steps=1)
    assert lines[0].startswith("layer anatomy")
    qkv = next(line for line in lines if line.strip().startswith("qkv"))
    assert qkv.split()[1:] == ["10.0", "gap", "-0.5"]
    assert (
        lines[-1] == "  in no repeated pattern: 0.083 ms per step"
    )  # embed, the last MLP half, lm_head
    assert report([], steps=1) == []
