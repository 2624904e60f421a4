"""Load each Hugging Face tokenizer folder once per test module, for the code under test.

``hf_tokenizer`` reads a folder with transformers' ``AutoTokenizer`` (0.5-5 s a
folder on the 2-core test machine, by its load); tests that build it many times
on the same few folders patch the module's ``AutoTokenizer`` with
:class:`LoadedOnce`. ``HFTokenizer`` keeps its own template, length and template
variables and changes nothing on the transformers tokenizer, so its instances may
share one. A folder that fails to load fails each time: nothing is cached.
"""

from contextlib import contextmanager

from transformers import AutoTokenizer


class LoadedOnce:
    """Stands in for ``AutoTokenizer``: ``from_pretrained`` returns the tokenizer loaded first for those arguments."""

    loaded: dict = {}

    @classmethod
    def from_pretrained(cls, folder, **kwargs):
        key = (str(folder), tuple(sorted(kwargs.items())))
        if key not in cls.loaded:
            cls.loaded[key] = AutoTokenizer.from_pretrained(folder, **kwargs)
        return cls.loaded[key]


@contextmanager
def each_tokenizer_loaded_once():
    """Within: ``torchtune_ext.data.hf_tokenizer`` loads a folder once; afterwards the tokenizers are dropped.
    The references a test compares with are to be loaded with transformers' own ``AutoTokenizer``."""
    import pytest

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("torchtune_ext.data.hf_tokenizer.AutoTokenizer", LoadedOnce)
        try:
            yield
        finally:
            LoadedOnce.loaded.clear()
