"""Benchmark results files: a second run of the day gets its own name, never the first's."""

import json
from pathlib import Path

from kvfleet_engine.bench.results import Row, write_results


def test_a_second_run_of_the_day_is_written_beside_the_first(tmp_path: Path) -> None:
    def run(value: float) -> Path:
        rows = [Row(system="kvfleet", metric="decode_tokens_per_s", value=value, unit="tokens/s")]
        return write_results(tmp_path, "chat-x", "cpu", "kvfleet bench chat", "x", {}, rows)

    first, second, third = run(1.0), run(2.0), run(3.0)
    assert second.name == first.name.replace(".json", "-run2.json")
    assert third.name == first.name.replace(".json", "-run3.json")
    values = [json.loads(p.read_text())["results"][0]["value"] for p in (first, second, third)]
    assert values == [1.0, 2.0, 3.0]
