"""A server choice's events beside the Pipeline (`ChoiceFeed`): their order and content, whatever
the stream loop's timing, with stand-in streams that make each timing happen every time."""

from __future__ import annotations

from types import SimpleNamespace

from mmpipe.app.serve_choices import ChoiceFeed, Failure

from mmpipe.errors import ImageLoadError


class Stream:
    """A TextStream stand-in whose request the stream loop finishes inside `subscribe`, before the
    preparing thread runs again (a one-token request on a fast engine)."""

    num_prompt_tokens = 7

    def __init__(self) -> None:
        self.aborted = False

    def subscribe(self, listener, after_step=None) -> None:
        listener("Hi", True)

    def tokens_since(self, start: int):
        return [42][start:], [{42: -0.5}][start:]

    def metrics(self):
        return SimpleNamespace(time_to_first_token_s=0.012)

    def output(self):
        return "the output"

    def abort(self) -> None:
        self.aborted = True


def test_ready_comes_before_an_end_the_loop_delivers_at_once():
    events: list[tuple] = []
    ChoiceFeed(Stream, events.append).run()
    assert events == [("ready",), ("delta", "Hi", [42], [{42: -0.5}], (0.012, 7)), ("end", "the output", 1)]


def test_a_stream_that_cannot_be_made_is_one_error_event_naming_the_input():
    def broken():
        raise ImageLoadError("image 0: not an image")

    events: list[tuple] = []
    ChoiceFeed(broken, events.append).run()
    assert events == [("error", Failure("input", "image 0: not an image"))]


def test_a_choice_stopped_while_its_stream_was_made_is_aborted_and_still_ends():
    made: list[Stream] = []
    events: list[tuple] = []
    feed = ChoiceFeed(lambda: made.append(Stream()) or made[-1], events.append)
    feed.stop()
    feed.run()
    assert made[0].aborted
    assert [e[0] for e in events] == ["ready", "end"]  # no text once stopped, but its end
