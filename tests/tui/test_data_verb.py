"""`dflash-tui data inspect`: the verb resolves its --target (builtin:tiny or a model folder) and
measures how often the trained labels are the target's own greedy next token."""

import json

from dflash_tui.cli import main


def test_inspect_measures_agreement_with_the_builtin_target_and_with_its_folder(
        demo_data, demo_target, capsys):
    shares = []
    for target in ("builtin:tiny", str(demo_target)):
        assert main(["data", "inspect", str(demo_data), "--target", target, "--json",
                     "--agreement-samples", "4", "--samples", "1"]) == 0
        report = json.loads(capsys.readouterr().out)
        a = report["agreement"]
        assert a["samples"] == 4 and a["positions"] > 0
        shares.append(a["share"])
    # The demo data's responses are this target's greedy continuations.
    assert shares[0] == shares[1] > 0.9


def test_inspect_without_a_target_reports_no_agreement(demo_data, capsys):
    assert main(["data", "inspect", str(demo_data), "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "trained" in out and "agreement" not in out
