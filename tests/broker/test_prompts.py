"""The prompt stream (broker/run_state.py) and its data position (broker/prompts.py) on a real Redis: indices are
handed out once, redo indices first; the recorded position is bounded and a restore continues where training
stopped; a changed prompt order is named field by field."""
from broker.prompts import DataPosition
from broker.run_state import restore_prompt_stream, take_prompt_indices


def test_indices_are_handed_out_once_redo_first(redis_server):
    client = redis_server.client()
    assert take_prompt_indices(client, "r", 3) == [0, 1, 2]
    assert take_prompt_indices(client, "r", 2) == [3, 4]
    position = DataPosition()
    position.add([0, 2, 4])                        # 1 and 3 were handed out but never trained
    restore_prompt_stream(client, "r", *position.untrained())
    assert take_prompt_indices(client, "r", 3) == [1, 3, 5]
    assert take_prompt_indices(client, "r", 2) == [6, 7]


def test_position_stays_bounded_by_what_is_in_flight():
    position = DataPosition(seed=3, data={"size": 64})
    for step in range(100):                        # 4 groups a step, one of each step arrives a step late
        position.add([4 * step, 4 * step + 1, 4 * step + 3] + ([4 * step - 2] if step else []))
    assert position.next_index == 4 * 99 + 2 and position.trained_ahead == [4 * 99 + 3]
    assert position.untrained() == ([4 * 99 + 2], 4 * 99 + 4)
    assert DataPosition.from_dict(position.to_dict()) == position


def test_a_changed_prompt_order_is_named_field_by_field():
    saved = DataPosition(next_index=8, seed=3, data={"size": 64, "source": "function"})
    assert saved.differences(3, {"size": 64, "source": "function"}) == []
    assert saved.differences(4, {"size": 32, "source": "function", "path": "x"}) == [
        "seed=4 (checkpoint: 3)", "actors.data.path='x' (checkpoint: None)", "actors.data.size=32 (checkpoint: 64)"]
