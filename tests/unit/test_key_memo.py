"""`prefix_keys.KeyMemo`: a request whose leading pages repeat a recent prompt's takes their keys
instead of hashing them, and every key it ends with is the one hashing alone gives: the reuse stops
at the first page where the token ids, their positions or an image differ, and never crosses a
salt."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mmpipe.engine.key_memo import GROUP_PAGES, KeyMemo
from mmpipe.engine.prefix_keys import extend_keys

PAGE = 4


class _Prompt:
    """What the keys read of a request: ids, M-RoPE positions, images (first token, key, length), salt."""

    def __init__(self, ids: list[int], images: list[tuple[int, str, int]] = (), salt: str | None = None,
                 shift_from: int | None = None) -> None:
        self.ids = list(ids)
        self.pos = np.tile(np.arange(len(ids)), (3, 1))
        if shift_from is not None:  # positions from there on differ (as after an image of another grid)
            self.pos[:, shift_from:] += 7
        self.image_starts = [first for first, _, _ in images]
        self.images = [SimpleNamespace(key=key, num_tokens=n) for _, key, n in images]
        self.sampling = SimpleNamespace(cache_salt=salt)
        self.cache_keys: list[bytes] = []
        self.total_len = len(ids)

    def tokens(self, start: int, end: int) -> list[int]:
        return self.ids[start:end]

    def positions_of(self, start: int, end: int) -> np.ndarray:
        return self.pos[:, start:end]


def _pages(prompt: _Prompt) -> int:
    return (prompt.total_len - 1) // PAGE  # as the scheduler asks: full pages before the last token


def _fresh_keys(prompt: _Prompt) -> list[bytes]:
    copy = _Prompt(prompt.ids)
    copy.pos, copy.image_starts, copy.images = prompt.pos, prompt.image_starts, prompt.images
    copy.sampling = prompt.sampling
    return extend_keys(copy, _pages(copy), PAGE)


def _admit(memo: KeyMemo, prompt: _Prompt) -> int:
    """The scheduler's order: seed from the memo, then hash what is left; the pages reused."""
    before = memo.reused_pages
    memo.seed(prompt, _pages(prompt), PAGE)
    keys = extend_keys(prompt, _pages(prompt), PAGE)
    assert keys == _fresh_keys(prompt)
    return memo.reused_pages - before


HISTORY = list(range(100, 140))  # 40 tokens, 10 pages; an image at 5..12 (pages 1-3)
IMAGE = [(5, "img-a", 8)]


def test_a_next_turn_takes_the_keys_of_its_history_and_hashes_only_its_new_pages():
    memo = KeyMemo()
    assert _admit(memo, _Prompt(HISTORY + [1, 2, 3], IMAGE)) == 0  # nothing remembered yet
    # The next turn: 43 tokens of history, 12 new. Its first page is hashed; pages 1..9 are taken
    # (page 10 holds tokens the two prompts do not share).
    assert _admit(memo, _Prompt(HISTORY + [1, 2, 3] + list(range(200, 212)), IMAGE)) == 10 - GROUP_PAGES
    # The same prompt again: every page but the first.
    assert _admit(memo, _Prompt(HISTORY + [1, 2, 3] + list(range(200, 212)), IMAGE)) == _pages(
        _Prompt(HISTORY + [1, 2, 3] + list(range(200, 212)))) - GROUP_PAGES


@pytest.mark.parametrize("token", [4, 5, 17, 21, 36, 39])
def test_reuse_stops_at_the_first_page_whose_ids_differ(token):
    memo = KeyMemo()
    _admit(memo, _Prompt(HISTORY + [1]))
    changed = HISTORY + [1]
    changed[token] = 9999
    assert _admit(memo, _Prompt(changed)) == max(0, token // PAGE - GROUP_PAGES)


def test_reuse_stops_at_the_first_page_whose_positions_differ():
    memo = KeyMemo()
    _admit(memo, _Prompt(HISTORY + [1]))
    assert _admit(memo, _Prompt(HISTORY + [1], shift_from=22)) == 22 // PAGE - GROUP_PAGES


@pytest.mark.parametrize("images, first_differing_page", [
    ([(21, "img-b", 6)], 1),  # no image in page 1 but another in page 5, same tokens
    ([(5, "img-a", 8), (21, "img-b", 6)], 5),  # the shared image, then one the first prompt lacks
    ([(5, "img-c", 8)], 1),  # another image where the first prompt had its image
])
def test_reuse_stops_at_the_first_page_holding_an_image_they_do_not_share(images, first_differing_page):
    memo = KeyMemo()
    _admit(memo, _Prompt(HISTORY + [1], IMAGE))
    assert _admit(memo, _Prompt(HISTORY + [1], images)) == max(0, first_differing_page - GROUP_PAGES)


def test_a_salt_shares_nothing():
    memo = KeyMemo()
    _admit(memo, _Prompt(HISTORY + [1]))
    assert _admit(memo, _Prompt(HISTORY + [1], salt="alice")) == 0
    assert _admit(memo, _Prompt(HISTORY + [1], salt="alice")) == _pages(_Prompt(HISTORY + [1])) - GROUP_PAGES


def test_keys_hashed_after_admission_are_taken_too():
    """The memo keeps the request's own key list: pages hashed later (the scheduler registers
    pages as they are computed) join it."""
    memo = KeyMemo()
    first = _Prompt(HISTORY + [1])
    memo.seed(first, _pages(first), PAGE)  # admission hashes its first pages only here...
    extend_keys(first, 3, PAGE)
    assert len(first.cache_keys) == 3
    extend_keys(first, _pages(first), PAGE)  # ...the rest once computed
    assert _admit(memo, _Prompt(HISTORY + [1])) == _pages(first) - GROUP_PAGES


def test_the_oldest_prompts_go_past_the_capacity():
    memo = KeyMemo(capacity_tokens=48)
    _admit(memo, _Prompt(HISTORY + [1]))  # its 40 tokens of full pages kept
    _admit(memo, _Prompt([7] + HISTORY))  # another first page: 40 more, over the capacity
    assert _admit(memo, _Prompt([7] + HISTORY)) == _pages(_Prompt([7] + HISTORY)) - GROUP_PAGES  # the newest stays
    assert _admit(memo, _Prompt(HISTORY + [1])) == 0  # the oldest was dropped


SYSTEM = list(range(500, 520))  # five pages every conversation shares (a system prompt)


def test_interleaved_conversations_with_one_system_prompt_each_take_their_own_history():
    memo = KeyMemo()
    talks = [SYSTEM + list(range(1000 * k, 1000 * k + 30)) for k in range(1, 9)]
    for k, talk in enumerate(talks):
        assert _admit(memo, _Prompt(talk + [1])) == (5 - GROUP_PAGES if k else 0)  # the shared system prompt only
    for k, talk in enumerate(talks):  # each one's next turn, the others' in between
        talks[k] = talk + [1] + list(range(7000 + 10 * k, 7010 + 10 * k))
        assert _admit(memo, _Prompt(talks[k])) == (len(talk) + 1) // PAGE - GROUP_PAGES
    first = extend_keys(_Prompt(SYSTEM), GROUP_PAGES, PAGE)[-1]
    assert list(memo._groups) == [first] and len(memo._groups[first]) == len(talks)  # a turn replaced the last


def test_a_group_keeps_its_newest_prompts():
    memo = KeyMemo(per_group=3)
    talks = [SYSTEM + list(range(1000 * k, 1000 * k + 30)) + [1] for k in range(1, 5)]
    for talk in talks:
        _admit(memo, _Prompt(talk))
    assert _admit(memo, _Prompt(talks[0] + [2, 3, 4, 5])) == 5 - GROUP_PAGES  # the oldest went: the system prompt only
    assert _admit(memo, _Prompt(talks[3] + [2, 3, 4, 5])) == len(talks[3]) // PAGE - GROUP_PAGES


def test_a_finished_request_lends_the_keys_of_its_answer_and_lets_go_of_its_list():
    memo = KeyMemo()
    request = _Prompt(HISTORY + [1])
    _admit(memo, request)
    request.ids += list(range(300, 320))  # its answer, decoded
    request.pos = np.tile(np.arange(len(request.ids)), (3, 1))
    request.total_len = len(request.ids)
    extend_keys(request, request.total_len // PAGE, PAGE)  # its answer's pages, registered as computed
    memo.finished(request, PAGE)
    (member,) = next(iter(memo._groups.values()))
    assert member.keys == request.cache_keys and member.keys is not request.cache_keys and member.request is None
    nxt = _Prompt(request.ids + [7, 8, 9, 10, 11])  # the next turn repeats the answer
    assert _admit(memo, nxt) == request.total_len // PAGE - GROUP_PAGES


def test_a_member_does_not_keep_its_request_alive():
    import gc

    memo = KeyMemo()
    request = _Prompt(HISTORY + [1])
    _admit(memo, request)
    (member,) = next(iter(memo._groups.values()))
    del request
    gc.collect()
    assert member.request() is None
    assert _admit(memo, _Prompt(HISTORY + [1])) == _pages(_Prompt(HISTORY + [1])) - GROUP_PAGES


def _answer(memo: KeyMemo, request: _Prompt, tokens: list[int]) -> None:
    """The request decodes `tokens`, its pages are registered as computed, and it finishes."""
    request.ids += tokens
    request.pos = np.tile(np.arange(len(request.ids)), (3, 1))
    request.total_len = len(request.ids)
    extend_keys(request, request.total_len // PAGE, PAGE)
    memo.finished(request, PAGE)


def test_the_same_prompt_asked_again_and_again_is_remembered_once():
    memo = KeyMemo()
    for _ in range(10):
        request = _Prompt(HISTORY + [1, 2, 3])
        _admit(memo, request)
        _answer(memo, request, [9, 9, 9, 9, 9])  # the same answer: a page past the prompt's
    (group,) = memo._groups.values()
    assert len(group) == 1 and len(group[0].ids) == len(request.ids) // PAGE * PAGE
    assert memo._tokens == len(group[0].ids)


def test_a_prompt_that_differs_only_before_its_last_page_is_not_taken_for_a_beginning():
    memo = KeyMemo()
    first = HISTORY + [1]  # pages 0-9 full
    _admit(memo, _Prompt(first))
    other = list(first)
    other[33] = 4321  # page 8 differs; page 9 (the last full one) is the same
    request = _Prompt(other)
    assert _admit(memo, request) == 8 - GROUP_PAGES
    _answer(memo, request, list(range(800, 812)))
    assert _admit(memo, _Prompt(first)) == _pages(_Prompt(first)) - GROUP_PAGES  # still remembered


def test_captions_of_new_images_after_a_short_system_prompt_share_no_group():
    """A group is found by its first pages, so a stream of new images (each starting in page 1)
    does not pile up in one group that every admission would search."""
    memo = KeyMemo()
    for i in range(100):
        _admit(memo, _Prompt(list(range(100, 106)) + [7] * 20 + list(range(200, 210)), [(6, f"image {i}", 20)]))
    assert max(len(group) for group in memo._groups.values()) == 1


def test_a_prompt_whose_positions_differ_only_in_its_last_page_is_not_taken_for_a_beginning():
    """Its ids and images begin the newer prompt, its last page's positions do not (as after an
    image of another grid): the newer prompt does not serve it, and both stay remembered."""
    memo = KeyMemo()
    first = _Prompt(HISTORY + [1], shift_from=37)  # pages 0-9; page 9's positions differ
    _admit(memo, first)
    request = _Prompt(HISTORY + [1, 2, 3, 4, 5, 6])
    assert _admit(memo, request) == 9 - GROUP_PAGES
    _answer(memo, request, list(range(800, 812)))
    (group,) = memo._groups.values()
    assert [len(known.ids) for known in group] == [40, len(request.ids) // PAGE * PAGE]


@pytest.mark.parametrize("older_shift, kept", [(37, True), (None, False)])
def test_prompts_whose_keys_are_partly_hashed_are_compared_by_their_tokens(older_shift, kept):
    """Neither prompt has keys yet for all of the older one's pages (a miss stopped the hashing):
    their keys cannot decide, their ids and positions do. An older prompt whose last page's
    positions differ is kept; one the newer begins is forgotten."""
    memo = KeyMemo()
    older = _Prompt(HISTORY + [1], shift_from=older_shift)
    memo.seed(older, _pages(older), PAGE)
    newer = _Prompt(HISTORY + [1, 2, 3, 4, 5, 6])
    memo.seed(newer, _pages(newer), PAGE)
    assert len(older.cache_keys) < _pages(older) and len(newer.cache_keys) < _pages(older)
    (group,) = memo._groups.values()
    assert [known.request() for known in group] == ([older, newer] if kept else [newer])
