"""The bounded account of refusals a round record keeps (server/rejections.py)."""

from __future__ import annotations

from edgefl.server.rejections import OTHER, TOP, Rejections


def test_a_record_counts_every_refusal_the_reasons_past_the_top_under_other():
    """With more distinct reasons (or senders) than a record shows, the rest were dropped without a
    word: by_reason summed to less than count. They count together under "(other)"."""
    rejections = Rejections()
    for i in range(TOP + 3):
        rejections.add(f"device-{i}", f"cause {chr(ord('a') + i)} of this refusal")
    rejections.add("device-0", "cause a of this refusal")
    summary = rejections.summary()
    assert summary["count"] == TOP + 4
    assert sum(summary["by_reason"].values()) == summary["count"] and summary["by_reason"][OTHER] == 3
    assert sum(summary["by_sender"].values()) == summary["count"] and summary["by_sender"][OTHER] == 3
    assert summary["by_reason"]["cause a of this refusal"] == 2 and len(summary["by_reason"]) == TOP + 1


def test_a_record_with_few_reasons_has_no_other():
    rejections = Rejections()
    rejections.add("device-0", "wrong shape")
    assert rejections.summary()["by_reason"] == {"wrong shape": 1} and OTHER not in rejections.summary()["by_sender"]


def test_edgefl_reports_notes_name_the_commonest_refusals_word_for_word(tmp_path):
    """`edgefl report` said only "12 messages refused (summary.json: ...)": it now lists the top
    reasons, each as the first refusal it folded, so an operator sees what was refused."""
    from edgefl.report import participation_notes
    from edgefl.rundir import RunDir

    rejections = Rejections()
    for i in range(3):
        rejections.add("client-2", f"extractor.1.weight: ({i}, 3) torch.float32, expected (32, 64) torch.float32")
    rejections.add("client-2", "extractor.1.weight holds NaN or Inf")
    run = RunDir.create(tmp_path / "run", "r", 0)
    run.write_json("summary.json", {"rejections": rejections.summary()})
    notes = participation_notes(run)
    assert notes[0].startswith("4 messages refused")
    assert "  3 x extractor.1.weight: (0, 3) torch.float32, expected (32, 64) torch.float32" in notes
    assert "  1 x extractor.1.weight holds NaN or Inf" in notes
