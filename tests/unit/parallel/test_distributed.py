"""torchtune_ext.parallel in this process: a gathered save under FSDP2 x tensor parallelism silences exactly
torch's remark about gathering a _StridedShard parameter.

Data-parallel exactness over 1 and 2 ranks (torchrun): tests/integration/distributed/test_distributed.py.
"""

import pytest


def test_a_gathered_save_silences_exactly_torchs_strided_shard_remark(caplog):
    """A gathered save under FSDP2 x tensor parallelism makes torch say, on every rank, that gathering a
    _StridedShard parameter "is suboptimal" (a remark about speed; the result is exact): the gather silences
    exactly that line (torch's own function writes it here), and only while it gathers."""
    import logging
    import warnings

    from torch.distributed.tensor import Replicate, Shard, _redistribute
    from torch.distributed.tensor.placement_types import _StridedShard

    from torchtune_ext.checkpoint.state_dict import quiet_strided_gather

    remark = getattr(_redistribute, "_warn_flatten_optimization_not_possible", None)
    if remark is None:
        pytest.skip("this torch version words the remark elsewhere")

    class Mesh:  # what the remark reads of the device mesh
        mesh_dim_names = ("dp", "tp")

    def say(mesh):
        remark(mesh, (0, 1), (_StridedShard(0, split_factor=2), Shard(0)), (Replicate(), Replicate()), 2,
               "allgather", "no_flattened_mesh")

    other = logging.getLogger(_redistribute.__name__)
    meshes = [Mesh(), Mesh()]  # torch says it once per mesh: two live ones, two lines
    with caplog.at_level("WARNING"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with quiet_strided_gather():
                say(meshes[0])
                warnings.warn("While redistributing from (_StridedShard(dim=0, sf=2), Shard(dim=0)): This is "
                              "suboptimal")
                other.warning("another remark of DTensor")
        assert [r.getMessage() for r in caplog.records] == ["another remark of DTensor"]
        assert caught == []
        say(meshes[1])  # outside a gather it is shown as before
    assert "_StridedShard" in caplog.records[-1].getMessage() and "suboptimal" in caplog.records[-1].getMessage()
