"""`dflash-tui --attach RUN_DIR --read-only` (what `dflash-tui serve` runs without --control):
a and r are refused on screen and nothing reaches the run; q still detaches."""

import pytest
from textual.screen import ModalScreen

import tui_scenarios as sc
from dflash_core.pipeline.inbox import command_dir
from dflash_tui.app import READ_ONLY_SERVED, DFlashApp, read_only_message
from dflash_tui.sources.follow import FollowController


@pytest.mark.anyio
async def test_a_read_only_view_refuses_abort_and_restart_and_still_detaches(tmp_path):
    with open(tmp_path / "events.jsonl", "w", encoding="utf-8") as f:
        f.writelines(e.to_json() + "\n" for e in sc.training())
    ctl = FollowController(tmp_path, poll_s=0.02)
    app = DFlashApp(ctl, run_dir=None, read_only=True)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause(1.2)
        assert "TRAINING" in app.query_one("#header").text
        assert "attached, read-only: q detaches" in app.query_one("#header").text
        for key in ("a", "r"):
            await pilot.press(key)
            await pilot.pause(0.2)
            assert not isinstance(app.screen, ModalScreen)  # no "are you sure?": refused
        await app.run_action("abort")  # the command palette's way in is refused too
        await pilot.pause(0.2)
        said = [n.message for n in app._notifications]
        # A terminal's view names the command that acts, for this run folder: not serve's flag.
        assert said == [f"read-only view: dflash-tui attach {tmp_path} --control allows "
                        "abort/restart"] * 3
        assert "serve" not in said[0]
        await pilot.press("q")
        await pilot.pause(0.5)
        assert not app.is_running
    assert not command_dir(tmp_path).exists()  # nothing was sent to the run


def test_read_only_goes_with_attach(capsys):
    from dflash_tui.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--demo", "--read-only"])
    assert exc.value.code == 2 and "--read-only goes with --attach" in capsys.readouterr().err


def test_the_read_only_message_names_attach_control_or_serve_where_served():
    assert read_only_message("runs/my run") == (
        "read-only view: dflash-tui attach 'runs/my run' --control allows abort/restart")
    assert read_only_message(None).startswith("read-only view: dflash-tui attach RUN_DIR --control")
    # A browser tab (serve started its attach): its user passes no command, serve takes the flag.
    assert read_only_message("runs/demo", served=True) == READ_ONLY_SERVED
    assert "serve with --control" in READ_ONLY_SERVED
