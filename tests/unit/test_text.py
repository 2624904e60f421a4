"""torchtune_ext.text: one-line errors, byte sizes, did-you-mean."""

from torchtune_ext.text import closest, format_bytes, short


def test_short_puts_an_error_on_one_line_with_its_cause():
    try:
        try:
            raise OSError("disk\n  full")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as err:
        assert short(err) == "RuntimeError: save failed (OSError: disk full)"
        assert short(err, with_cause=False) == "RuntimeError: save failed"
    assert short(ValueError()) == "ValueError"


def test_short_leaves_out_a_cause_it_already_says():
    try:
        try:
            raise OSError("no space")
        except OSError as inner:
            raise RuntimeError(f"write: {inner}") from inner
    except RuntimeError as err:
        assert short(err) == "RuntimeError: write: no space"


def test_format_bytes_uses_binary_units_and_three_figures():
    assert format_bytes(512) == "512 B"
    assert format_bytes(12 * 2**20) == "12 MiB"
    assert format_bytes(1.61 * 2**30) == "1.61 GiB"
    assert format_bytes(3 * 2**40) == "3 TiB"


def test_closest_finds_a_misspelling_or_an_alias():
    known = ["batch_size", "batch_size_val", "epochs"]
    assert closest("batchsize", known) == "batch_size"
    assert closest("val_batch_size", known, {"val_batch_size": "batch_size_val"}) == "batch_size_val"
    assert closest("learning_rate", known) is None
