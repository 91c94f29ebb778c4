import pytest

from trireme.cli import main


def test_config_doc_reads_its_arguments(capsys):
    """`trireme config-doc --help` printed the whole reference instead of the help, and
    `config-doc --typo` was taken silently: its parser was built but never asked."""
    with pytest.raises(SystemExit) as done:
        main(["config-doc", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: trireme config-doc") and "| key |" not in out
    with pytest.raises(SystemExit) as done:
        main(["config-doc", "--typo"])
    assert done.value.code == 2 and "unrecognized arguments: --typo" in capsys.readouterr().err
    assert main(["config-doc"]) == 0
    assert capsys.readouterr().out.startswith("# Config reference")


def test_bare_trireme_prints_its_usage_and_starts_nothing(tmp_path, monkeypatch, capsys):
    """`trireme` with no arguments printed nothing of its commands and started a 300-step run of
    the tiny preset (setting the previous run's metrics aside); it prints the usage, exit 0."""
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The `trireme` command") and "trireme train" in out
    assert list(tmp_path.iterdir()) == []  # no run directory, no data cache
