"""The response id -> backend map and the two readers that learn it (JSON answers, event streams)."""

from __future__ import annotations

import json

import pytest

from proxy.dataplane.response_homes import SNIFF_LIMIT_BYTES, CreatedSniffer, ResponseHomes, response_id_from_json


def test_the_map_is_bounded_and_a_lookup_keeps_an_entry_young() -> None:
    homes = ResponseHomes(max_entries=3)
    for i in range(3):
        homes.learn(f"r{i}", f"b{i}")
    assert homes.home("r0") == "b0"  # used: now the youngest
    homes.learn("r3", "b3")  # r1 (the oldest) goes
    assert homes.home("r1") is None and homes.home("r0") == "b0" and len(homes) == 3
    homes.learn("r0", "b9")
    assert homes.home("r0") == "b9"
    with pytest.raises(ValueError):
        ResponseHomes(0)


def test_the_id_of_a_json_answer() -> None:
    assert response_id_from_json(b'{"id":"resp_1","object":"response"}') == "resp_1"
    assert response_id_from_json(b'{"object": "response", "id": "resp_2"}') == "resp_2"  # not first: parsed
    assert response_id_from_json(b'not json') is None
    assert response_id_from_json(b'[1]') is None
    assert response_id_from_json(b'{"id": 3}') is None


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


@pytest.mark.parametrize("piece", [1, 7, 10_000])
def test_the_created_event_names_the_response_in_pieces_of_any_size(piece: int) -> None:
    stream = (_event("response.created", {"response": {"id": "resp_abc", "status": "in_progress"}})
              + _event("response.output_text.delta", {"delta": "hi"}))
    s = CreatedSniffer()
    for i in range(0, len(stream), piece):
        s.feed(stream[i:i + piece])
    assert s.done and s.response_id == "resp_abc"


def test_the_sniffer_gives_up_on_a_stream_without_the_created_event_first() -> None:
    s = CreatedSniffer()
    s.feed(b": a comment\n\n" + _event("response.in_progress", {"response": {"id": "resp_x"}}))
    assert s.done and s.response_id is None
    s = CreatedSniffer()
    s.feed(b"data: " + b"x" * (SNIFF_LIMIT_BYTES + 1))
    assert s.done and s.response_id is None
    s = CreatedSniffer()
    s.feed(b"data: {not json\r\n\r\n")
    assert s.done and s.response_id is None


def test_a_json_answer_relayed_in_pieces_names_its_leading_id() -> None:
    s = CreatedSniffer(sse=False)
    for piece in (b' {"i', b'd": "resp_', b'9", "object": "response"}'):
        s.feed(piece)
    assert s.done and s.response_id == "resp_9"
    s = CreatedSniffer(sse=False)
    s.feed(b'{"object": "response", "id": "late"' + b" " * 600)
    assert s.done and s.response_id is None
    s = CreatedSniffer(sse=False)
    s.feed(b"[]")
    assert s.done and s.response_id is None
