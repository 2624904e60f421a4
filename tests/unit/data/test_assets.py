"""torchtune_ext.data.assets: a missing asset names its path and the download command.

The download command itself: tests/unit/tools/test_download.py.
"""


import pytest

from torchtune_ext.data.assets import (
    DOWNLOAD_COMMAND,
    MissingAssetError,
    check_asset,
    require_assets,
)


def test_missing_asset_error_names_path_and_command(tmp_path):
    missing = tmp_path / "nowhere" / "data" / "shakespeare.jsonl"
    with pytest.raises(MissingAssetError) as info:
        check_asset(missing)
    msg = str(info.value)
    assert str(missing) in msg
    assert f"Create it with: {DOWNLOAD_COMMAND} --output-dir {tmp_path / 'nowhere'}" in msg
    assert isinstance(info.value, FileNotFoundError)


def test_missing_default_asset_gives_plain_command():
    with pytest.raises(MissingAssetError, match=r"Create it with: python -m torchtune_ext.download\n"):
        check_asset("assets/SmolLM2-135M-Instruct/not-a-file.bin")


def test_require_assets_reports_every_missing_path(tmp_path):
    present = tmp_path / "here.txt"
    present.write_text("x")
    with pytest.raises(MissingAssetError) as info:
        require_assets([present, tmp_path / "a", tmp_path / "b"])
    msg = str(info.value)
    assert f"  {tmp_path / 'a'}\n  {tmp_path / 'b'}\nCreate them with: {DOWNLOAD_COMMAND}" in msg
    assert str(present) not in msg
    assert require_assets([present]) == [present]
