"""check counts its exact decoding's rounds by context length too (context_buckets.py): the rounds
its tau counts, each at its anchor + 1, in the target's buckets; the evidence says them when
they fall in more than one, and check.json keeps them."""

from dflash_core.check import diagnose as diag
from dflash_core.check.decode import DecodeResult, SampleDecode
from dflash_core.context_buckets import Buckets


def _result(buckets):
    resp = list(range(10, 26))
    # block 4, prompt of 4 tokens: rounds at anchors 4, 6, 8, ... each accepting one draft
    drafts, acc, s = [], [], 4
    while s + 4 <= 4 + len(resp):
        drafts.append((s, [resp[s - 4 + 1], 0, 0]))
        acc.append(1)
        s += 2
    return DecodeResult("this engine", 4, [SampleDecode(resp, resp, acc, drafts, 4)],
                        buckets=buckets)


def test_the_rounds_tau_counts_by_context_and_the_evidence_line():
    d = _result(Buckets((10,), None))
    recs = d.by_context()
    # anchors 4, 6, 8 (positions 5, 7, 9) below the edge; 10, 12, 14, 16 at or past it
    assert [(r["bucket"], r["rounds"], r["accepted"]) for r in recs] == [
        ("0-10", 3, 3), ("10+", 4, 4)]
    assert sum(r["rounds"] for r in recs) == len(list(d._rounds()))
    assert recs[0]["tau"] == d.tau == 2.0
    probes = diag.Probes(leak=0.0, leak_changed=0.0, decode_differs=0.0, decode_gap=0.0)
    lines = diag.evidence_lines(d, None, 3.9, 4.0, probes)
    assert "  tau by context 0-10 2.00 (3) | 10+ 2.00 (4)" in lines
    one = diag.evidence_lines(_result(Buckets.of(1024)), None, 3.9, 4.0, probes)
    assert not any("by context" in line for line in one)  # all in 0-128: tau says it
