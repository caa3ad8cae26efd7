"""loadtest/profile_sockets.py: py-spy's raw (folded) output read into system-call and step shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.profile_sockets import _shares


def test_shares_split_system_calls_from_python(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "main (proxy/cli.py:10);HttpConnection._write_answer (proxy/http/server.py:484);write (libc.so.6) 30\n"
        "main (proxy/cli.py:10);UpstreamPool._start (proxy/upstream/http1.py:628);write (libc.so.6) 20\n"
        "main (proxy/cli.py:10);uv__read (stream.c:1);read (libc.so.6) 10\n"
        "main (proxy/cli.py:10);OpenAIPipeline.summarise (proxy/dataplane/openai.py:280) 25\n"
        "main (proxy/cli.py:10);OpenAIPipeline.summarise (proxy/dataplane/openai.py:290);"
        "summary_from_openai (proxy/core/request.py:400) 15\n"
    )
    _shares(str(raw), top=3)
    out = capsys.readouterr().out
    assert "100 samples; system calls (kernel time included) 60.0%" in out
    assert " 50.0%  write (libc.so.6)" in out
    assert " 40.0%  OpenAIPipeline.summarise" in out  # inclusive: both of its lines, whatever the line number
    assert " 30.0%  HttpConnection._write_answer" in out
    assert " 20.0%  UpstreamPool._start" in out
    own = out.split("own samples")[1]
    assert own.index("write (libc.so.6)") < own.index("OpenAIPipeline.summarise")


def test_no_samples_is_an_error(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text("")
    with pytest.raises(SystemExit, match="no samples"):
        _shares(str(raw), top=3)


def test_a_compiled_step_is_found_by_its_c_name() -> None:
    from loadtest.profile_sockets import is_step

    # mypyc's names (proxy/native), as py-spy --native shows them
    assert is_step("CPyDef_server___HttpConnection____write_answer", "HttpConnection._write_answer")
    assert is_step("CPyDef_openai___OpenAIPipeline___summarise", "OpenAIPipeline.summarise")
    assert is_step("CPyDef_openai____exchange_OpenAIPipeline_gen_____mypyc_generator_helper__",
                   "OpenAIPipeline._exchange")
    assert is_step("OpenAIPipeline.summarise", "OpenAIPipeline.summarise")
    assert not is_step("CPyDef_openai___OpenAIPipeline___summarise_json", "OpenAIPipeline.summarise")
    assert not is_step("CPyDef_router___Lease___finish", "Lease.enter")
    assert not is_step("create_task", "OpenAIPipeline.summarise")
