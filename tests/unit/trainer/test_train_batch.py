"""The trainer's batch record (fastpo/trainer/batch.py): selection and concatenation keep every
field together, replay items round-trip, and a field in only some parts is refused."""
import pytest
import torch

from fastpo.trainer.batch import TrainBatch


def _batch(n, start=0, window=False, values=True):
    rows = [torch.arange(start + i, start + i + 3 + i) for i in range(n)]
    f = [x.float() for x in rows]
    return TrainBatch(rows, [torch.ones(x.numel(), dtype=torch.bool) for x in rows], f, [7] * n,
                      old_logprobs=[x + 0.5 for x in f], advantages=[x * 2 for x in f],
                      values=[x - 1 for x in f] if values else None,
                      context_turns=[x.long() for x in rows] if window else None,
                      visible_from=[x.long() + 1 for x in rows] if window else None)


def test_select_keeps_every_field_of_each_trajectory_together():
    b = _batch(4, window=True)
    s = b.select([3, 1])
    assert len(s) == 2 and s.sampled_at == [7, 7]
    for field in ("input_ids", "loss_mask", "sample_logprobs", "old_logprobs", "advantages", "values",
                  "context_turns", "visible_from"):
        assert torch.equal(getattr(s, field)[0], getattr(b, field)[3]), field
        assert torch.equal(getattr(s, field)[1], getattr(b, field)[1]), field
    assert s.returns is None and s.ref_logprobs is None
    turn, vis = s.window(0)  # the context window's labels are plain fields: they survive selection
    assert torch.equal(turn, b.context_turns[3]) and torch.equal(vis, b.visible_from[3])
    assert _batch(1).window(0) is None


def test_concat_appends_in_order_and_refuses_a_field_in_only_some_parts():
    a, b = _batch(2), _batch(3, start=10)
    c = TrainBatch.concat([a, b])
    assert len(c) == 5 and torch.equal(c.advantages[2], b.advantages[0])
    with pytest.raises(ValueError, match="'values'"):
        TrainBatch.concat([a, _batch(1, values=False)])


def test_rows_round_trip_through_replay_items():
    b = _batch(3)
    items = b.rows()
    assert set(items[0]) == {"input_ids", "loss_mask", "sample_logprobs", "old_logprobs", "advantages", "values",
                             "iteration"}
    back = TrainBatch.from_rows(items)
    assert back.sampled_at == [7, 7, 7] and back.returns is None
    for field in ("input_ids", "old_logprobs", "values"):
        assert all(torch.equal(x, y) for x, y in zip(getattr(back, field), getattr(b, field)))
    empty = TrainBatch.from_rows([])
    assert len(empty) == 0 and empty.old_logprobs == [] and empty.values is None
