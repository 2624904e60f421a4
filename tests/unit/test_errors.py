"""torchtune_ext.errors: the exit contract and the exception hierarchy it rests on."""

from torchtune_ext import errors


def test_the_exit_statuses_are_the_documented_ones_and_distinct():
    assert (errors.EXIT_USER_ERROR, errors.EXIT_TRAINING_FAILED, errors.EXIT_IO_ERROR, errors.EXIT_STOPPED) == \
        (2, 3, 74, 75)
    assert errors.REPORTED_EXIT_CODES == (2, 3, 74, 75)


def test_each_error_maps_to_one_exit_status():
    # exit_on_user_error catches these three families, each with its own status
    assert issubclass(errors.ConfigError, errors.UserError)
    assert issubclass(errors.DiskSpaceError, errors.ConfigError)  # before training: bad input, 2
    assert issubclass(errors.OutputWriteError, errors.CheckpointSaveError)  # a failed write during training: 74
    assert issubclass(errors.NonFiniteError, errors.TrainingHealthError)  # 3
    families = (errors.UserError, errors.CheckpointSaveError, errors.TrainingHealthError)
    for one in families:
        assert not any(issubclass(one, other) for other in families if other is not one)


def test_a_config_error_names_its_key():
    err = errors.ConfigError("batch_size", "expected a positive integer, got 0")
    assert err.key == "batch_size"
    assert str(err) == "config key 'batch_size': expected a positive integer, got 0"


def test_a_non_finite_error_says_its_values_and_suspects_the_step_before():
    err = errors.NonFiniteError(7, float("nan"), 1.5)
    assert str(err) == "non-finite values at optimizer step 7: loss=nan, grad_norm=1.5"
    assert (err.step, err.suspect_from) == (7, 6)
