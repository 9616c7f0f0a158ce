"""The scene generator is deterministic and its captions say what is drawn; the trainer runs."""

from __future__ import annotations

import numpy as np
from mmpipe.app.tiny.scenes import (
    COLOURS,
    MAX_SIDE,
    MIN_SIDE,
    SHAPES,
    caption_of,
    make_scene,
    parse_caption,
    score,
)


def test_same_seed_same_scene_and_different_seeds_differ():
    a, b, c = make_scene(7), make_scene(7), make_scene(8)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image)) and a.caption == b.caption
    assert not np.array_equal(np.asarray(a.image), np.asarray(c.image))


def test_scenes_cover_the_vocabulary_and_sizes():
    scenes = [make_scene(s) for s in range(300)]
    objects = [o for s in scenes for o in s.objects]
    assert {o.shape for o in objects} == set(SHAPES) and {o.colour for o in objects} == set(COLOURS)
    assert {len(s.objects) for s in scenes} == {1, 2, 3, 4}
    assert {(o.row, o.col) for o in objects} == {(r, c) for r in range(3) for c in range(3)}
    sizes = {s.image.size for s in scenes}
    assert len(sizes) > 200 and all(MIN_SIDE <= w <= MAX_SIDE and MIN_SIDE <= h <= MAX_SIDE for w, h in sizes)


def test_caption_lists_objects_in_reading_order_and_parses_back():
    scene = make_scene(3_000_000_000)  # assets/images/scene_0.png
    assert scene.caption == ("a large blue square at the top left, a large orange square at the top, a small "
                             "purple circle at the top right and a small orange circle at the bottom left")
    assert parse_caption(scene.caption) == [(o.size, o.colour, o.shape) for o in scene.objects]
    assert caption_of(list(reversed(scene.objects))) == scene.caption


def test_the_drawn_colour_is_where_the_caption_says():
    scene = make_scene(11)
    pixels = np.asarray(scene.image, dtype=np.float32)
    h, w = pixels.shape[:2]
    for obj in scene.objects:
        cell = pixels[obj.row * h // 3:(obj.row + 1) * h // 3, obj.col * w // 3:(obj.col + 1) * w // 3]
        distance = np.abs(cell - np.array(COLOURS[obj.colour], np.float32)).sum(-1)
        assert (distance < 80).mean() > 0.02  # a visible patch of the object's colour


def test_score():
    refs = [make_scene(s).caption for s in range(4)]
    assert refs[2] == "a large cyan square on the right"
    preds = refs[:2] + ["a small cyan square on the left", "nonsense"]  # wrong size and place only
    result = score(preds, refs)
    assert result["exact"] == 0.5 and result["n"] == 4
    assert result["colour_shape_scenes"] == 0.75


def test_trainer_runs_a_few_steps_and_saves_a_loadable_checkpoint(tmp_path):
    from mmpipe.app.tiny.train import main

    from mmpipe import Pipeline

    record = main(["--out", str(tmp_path / "m"), "--steps", "2", "--batch-size", "2", "--workers", "0",
                   "--eval-scenes", "2", "--vision", '{"depth": 2, "hidden_size": 32, "intermediate_size": 64, '
                   '"num_heads": 2, "fullatt_block_indexes": [1]}', "--text", '{"hidden_size": 32, '
                   '"intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, '
                   '"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}'])
    assert record["steps"] == 2 and record["eval"]["n"] == 2
    pipe = Pipeline.from_pretrained(str(tmp_path / "m"), device="cpu")
    assert isinstance(pipe.caption([make_scene(1).image])[0], str)
