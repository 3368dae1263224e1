"""Checkpoint checksums: damaged array data is never resumed from, whatever the mesh.

Tensorstore decodes many damaged bytes into other numbers without an error; the checksums that
`checkpoint.save` records make such a checkpoint unreadable, so the run resumes from the one
before it (the damaged folder is moved aside, nothing is deleted).
"""

import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from skipless_jax import checkpoint
from skipless_jax.checkpoint import integrity

GARBAGE = 64  # bytes written over the data file


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


MESH = _mesh((4, 2), ("data", "fsdp"))


def _specs():
    """Where each leaf lives on MESH: some sharded over one or both axes, some replicated."""
    return {
        "step": P(),
        "params": {"w": P("data", "fsdp"), "b": P("fsdp"), "e": P()},
        "opt_state": {"count": P(), "mu": P(None, "data"), "flags": P("data")},
        "rng": P(),
        "key": P(),
    }


def _values(seed):
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    return {
        "step": jnp.int32(seed),
        "params": {
            "w": jax.random.normal(k[0], (128, 256)),
            "b": jax.random.normal(k[1], (256,), jnp.bfloat16),
            "e": jax.random.normal(k[2], (32, 16)),
        },
        "opt_state": {
            "count": jnp.int32(7 * seed),
            "mu": jax.random.normal(k[3], (16, 64)),
            "flags": jax.random.bernoulli(k[4], 0.5, (8,)),
        },
        "rng": k[4],  # a raw uint32[2] key, as the trainers keep it
        "key": jax.random.key(seed),  # a typed PRNG key array
    }


def _shardings(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def _state(seed, mesh=MESH, specs=None):
    return jax.device_put(_values(seed), _shardings(mesh, specs or _specs()))


def _target(shardings):
    return checkpoint.abstract(jax.eval_shape(lambda: _values(0)), shardings)


def _host(tree):
    """Comparable host values (typed keys as their key data)."""
    return jax.tree.map(
        lambda x: np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x), tree
    )


def _assert_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, _host(a), _host(b))


def _files(root):
    """Every regular file under `root` (relative paths)."""
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _largest_data_file(step_dir):
    files = [os.path.join(step_dir, f) for f in _files(step_dir)]
    return max(files, key=os.path.getsize)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A workdir with the checkpoints of steps 1 and 2 of `_state`."""
    workdir = str(tmp_path_factory.mktemp("saved"))
    mngr = checkpoint.manager(workdir)
    for step in (1, 2):
        checkpoint.save(mngr, step, _state(step), {"step": step})
    mngr.wait_until_finished()
    mngr.close()
    return workdir


def _copy(saved, path):
    shutil.copytree(saved, str(path))
    return str(path)


def _restore_latest(workdir, shardings):
    mngr = checkpoint.manager(workdir)
    try:
        return checkpoint.restore_latest(mngr, _target(shardings))
    finally:
        mngr.close()


def _flip_bit(x, index, bit):
    words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(words.at[index].set(words[index] ^ (1 << bit)), x.dtype)


@pytest.mark.slow
def test_checksums_depend_on_the_value_only():
    values = _values(3)
    reference = checkpoint.checksums(_state(3))
    # Other meshes, other shardings, one device, numpy: the same checksums.
    other = _mesh((2, 4), ("a", "b"))
    specs = {
        "step": P(),
        "params": {"w": P("b", "a"), "b": P(("a", "b")), "e": P("b")},
        "opt_state": {"count": P(), "mu": P("a", "b"), "flags": P("b")},
        "rng": P("a"),
        "key": P(),
    }
    assert checkpoint.checksums(jax.device_put(values, _shardings(other, specs))) == reference
    assert checkpoint.checksums(jax.device_put(values, SingleDeviceSharding(jax.devices()[5]))) == reference
    assert checkpoint.checksums({**values, "params": jax.tree.map(np.asarray, values["params"])}) == reference
    assert set(reference) == {
        "step",
        "params/w",
        "params/b",
        "params/e",
        "opt_state/count",
        "opt_state/mu",
        "opt_state/flags",
        "rng",
        "key",
    }
    # One changed element, two swapped elements, one flipped bit: other checksums.
    w = values["params"]["w"]
    for changed in (w.at[77, 3].add(1.0), w[jnp.array([1, 0] + list(range(2, 128)))], _flip_bit(w, (5, 7), 9)):
        assert checkpoint.checksums({"w": changed})["w"] != checkpoint.checksums({"w": w})["w"]
    # The same bits as another dtype or shape: another record.
    assert checkpoint.checksums({"x": w.reshape(256, 128)})["x"] != checkpoint.checksums({"x": w})["x"]


def test_host_checksums_equal_the_device_program():
    """Arrays this process holds whole on the CPU are summed in numpy, the others by the jitted
    program: both give the same lanes for every dtype the host path takes."""
    rng = np.random.default_rng(0)
    leaves = {
        "f32": jnp.asarray(rng.normal(size=(7, 5)), jnp.float32),
        "bf16": jnp.asarray(rng.normal(size=(3, 4, 5)), jnp.bfloat16),
        "f16": jnp.asarray(rng.normal(size=(9,)), jnp.float16),
        "i8": jnp.asarray(rng.integers(-128, 127, (6, 6)), jnp.int8),
        "u32": jnp.asarray(rng.integers(0, 2**32, (4, 3), dtype=np.uint64).astype(np.uint32)),
        "i32_scalar": jnp.asarray(-7, jnp.int32),
        "bool": jnp.asarray(rng.random((5, 2)) > 0.5),
        "key": jax.random.key(3),
        "empty": jnp.zeros((0, 4), jnp.float32),
    }
    for name, x in leaves.items():
        host = integrity._host_words(x)
        assert host is not None, name
        want = np.asarray(integrity._checksums_of((x,)))[0]
        np.testing.assert_array_equal(integrity._host_checksum(host), want, err_msg=name)
    spanning = jax.device_put(leaves["f32"], NamedSharding(_mesh((8,), ("a",)), P()))
    assert integrity._host_words(spanning) is not None  # replicated on this process's devices
    assert integrity._host_words(jnp.zeros(3, jnp.complex64)) is None  # complex: the device program


def test_damaged_newest_checkpoint_is_never_resumed_from(saved, tmp_path, caplog):
    """GARBAGE bytes at the start, middle, end and 8 spread positions of the newest checkpoint's
    largest data file: the restore either falls back to step 1 (the folder of step 2 moved aside,
    every file kept), or, where the bytes are ones no read uses (e.g. a superseded index node at
    the end of a data file), returns step 2 bit-identical to what was saved. Never other values."""
    data_file = _largest_data_file(os.path.join(saved, "checkpoints", "2"))
    relative = os.path.relpath(data_file, saved)
    size = os.path.getsize(data_file)
    assert size > 8_000, (relative, size)  # array data (one shard of w is 16 KiB)
    offsets = sorted({0, size // 2, size - GARBAGE, *np.linspace(0, size - GARBAGE, 8).astype(int).tolist()})
    rng = np.random.default_rng(0)
    expected = {step: _host(_values(step)) for step in (1, 2)}
    fell_back = []
    for offset in offsets:
        workdir = _copy(saved, tmp_path / f"at_{offset}")
        before = _files(os.path.join(workdir, "checkpoints"))
        with open(os.path.join(workdir, relative), "r+b") as f:
            f.seek(offset)
            f.write(rng.integers(0, 256, GARBAGE, dtype=np.uint8).tobytes())

        # Only the parameters (config.init_from, analyze): read-only, never moves a folder.
        step, params = checkpoint.restore_params(workdir, _target(_shardings(MESH, _specs()))["params"])
        _assert_equal(params, expected[step]["params"])
        assert _files(os.path.join(workdir, "checkpoints")) == before

        caplog.clear()
        with caplog.at_level(logging.INFO, logger="absl"):
            step, state, meta = _restore_latest(workdir, _shardings(MESH, _specs()))
        log = "\n".join(r.getMessage() for r in caplog.records)
        _assert_equal(state, expected[step])  # the values saved at the step it says
        assert meta == {"step": step}
        if step == 2:  # the damaged bytes are read by nothing
            assert "is unreadable" not in log
            assert _files(os.path.join(workdir, "checkpoints")) == before
            continue
        fell_back.append((offset, "checksum" if "(corrupt: the values of" in log else "read error"))
        assert step == 1, log
        assert "Checkpoint at step 2 is unreadable (" in log, log
        assert "Using the checkpoint of step 1 (unreadable: step 2)" in log, log
        # Nothing deleted: step 2's files are kept aside, step 1's in place.
        after = [f for f in _files(os.path.join(workdir, "checkpoints")) if not f.startswith("2/")]
        aside = _files(os.path.join(workdir, "checkpoints_unreadable", "2"))
        assert sorted(after + ["2/" + f for f in aside]) == before
        assert not os.path.exists(os.path.join(workdir, "checkpoints", "2"))
    # Nearly every position lies in array data (before checksums, most of them went unnoticed).
    print(f"fell back to step 1 at {len(fell_back)} of {len(offsets)} offsets of {size} bytes: {fell_back}")
    assert len(fell_back) >= len(offsets) - 2, (fell_back, offsets)


def test_damage_found_by_the_checksums_names_the_array(saved, tmp_path, caplog):
    """A value changed in place but still well-formed on disk is found by its checksum only."""
    workdir = _copy(saved, tmp_path / "run")
    # Rewrite step 2 with one element of w changed, keeping step 2's recorded checksums.
    mngr = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"), item_names=(checkpoint.STATE, checkpoint.META))
    meta = mngr.restore(2, args=ocp.args.Composite(**{checkpoint.META: ocp.args.JsonRestore()}))[checkpoint.META]
    mngr.close()
    shutil.rmtree(os.path.join(workdir, "checkpoints", "2"))
    state = _state(2)
    state["params"]["w"] = state["params"]["w"].at[100, 200].multiply(1.0001)
    mngr = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"), item_names=(checkpoint.STATE, checkpoint.META))
    mngr.save(
        2,
        args=ocp.args.Composite(
            **{checkpoint.STATE: ocp.args.StandardSave(state), checkpoint.META: ocp.args.JsonSave(meta)}
        ),
    )
    mngr.wait_until_finished()
    mngr.close()
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"params/w differ from the saved ones"):
        checkpoint.restore_from_path(os.path.join(workdir, "checkpoints", "2"), _target(_shardings(MESH, _specs())))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"step 2 .* params/w"):
        checkpoint.load_raw(workdir, 2)
    with caplog.at_level(logging.INFO, logger="absl"):
        step, _, _ = checkpoint.restore_from_path(
            workdir, _target(_shardings(MESH, _specs()))
        )  # another run's: nothing moved
    assert step == 1
    assert "Checkpoint at step 2 is unreadable (corrupt: the values of params/w differ" in caplog.text
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "2"))
    with caplog.at_level(logging.INFO, logger="absl"):
        step, state, _ = _restore_latest(workdir, _shardings(MESH, _specs()))
    assert step == 1
    assert os.path.isdir(os.path.join(workdir, "checkpoints_unreadable", "2"))


def test_undamaged_checkpoint_verifies_on_another_mesh(saved, tmp_path, caplog):
    workdir = _copy(saved, tmp_path / "run")
    other = _mesh((2, 2, 2), ("x", "y", "z"))
    specs = {
        "step": P(),
        "params": {"w": P(("y", "z"), "x"), "b": P(), "e": P("x", "z")},
        "opt_state": {"count": P(), "mu": P("z", ("x", "y")), "flags": P(("x", "y", "z"))},
        "rng": P(),
        "key": P(),
    }
    with caplog.at_level(logging.INFO, logger="absl"):
        step, state, meta = _restore_latest(workdir, _shardings(other, specs))
        assert step == 2 and meta == {"step": 2}
        assert state["params"]["w"].sharding == NamedSharding(other, specs["params"]["w"])
        _assert_equal(state, _values(2))
        # One device of one process; only the parameters; as saved.
        device = SingleDeviceSharding(jax.devices()[3])
        step, state, _ = checkpoint.restore_from_path(
            os.path.join(workdir, "checkpoints", "2"),
            _target(jax.tree.map(lambda _: device, _specs(), is_leaf=lambda s: isinstance(s, P))),
        )
        _assert_equal(state, _values(2))
        step, params = checkpoint.restore_params(
            workdir, {"w": checkpoint.abstract(jax.ShapeDtypeStruct((128, 256), jnp.float32), device)}
        )
        assert step == 2
        _assert_equal(params, {"w": _values(2)["params"]["w"]})
        _assert_equal(checkpoint.load_raw(workdir, 1)[1], _values(1))
    assert checkpoint.param_shapes(workdir) == {"w": (128, 256), "b": (256,), "e": (32, 16)}
    assert checkpoint.param_shapes(os.path.join(workdir, "checkpoints"), "opt_state")["mu"] == (16, 64)
    assert "unreadable" not in caplog.text and "unverified" not in caplog.text and "not verified" not in caplog.text
    assert not os.path.exists(os.path.join(workdir, "checkpoints_unreadable"))


def test_checkpoint_without_checksums_still_restores(tmp_path, caplog):
    """Checkpoints written before checksums were recorded: restored, with a warning."""
    workdir = str(tmp_path)
    mngr = checkpoint.manager(workdir, async_save=False)
    for step in (1, 2):  # as `checkpoint.save` wrote them before
        mngr.save(
            step,
            args=ocp.args.Composite(
                **{
                    checkpoint.STATE: ocp.args.StandardSave(_state(step)),
                    checkpoint.META: ocp.args.JsonSave({"step": step}),
                }
            ),
        )
    mngr.close()
    with caplog.at_level(logging.INFO, logger="absl"):
        step, state, meta = _restore_latest(workdir, _shardings(MESH, _specs()))
        assert (step, meta) == (2, {"step": 2})
        _assert_equal(state, _values(2))
        step, params = checkpoint.restore_params(workdir, _target(_shardings(MESH, _specs()))["params"])
        assert step == 2
        _assert_equal(params, _values(2)["params"])
        _assert_equal(checkpoint.load_raw(workdir)[1], _values(2))
    assert "Checkpoint at step 2 has no checksums" in caplog.text
    assert "unreadable" not in caplog.text
    assert checkpoint.saved_config(workdir) is None  # and no config either


def test_saved_config(tmp_path):
    assert checkpoint.saved_config(str(tmp_path / "missing")) is None
    assert checkpoint.saved_config(str(tmp_path)) is None  # no checkpoints yet
    configs = {}
    mngr = checkpoint.manager(str(tmp_path), async_save=False)
    for step in (1, 2):
        config = ml_collections.ConfigDict(
            {"seed": step, "model": {"width": 8 * step, "name": "vit"}, "mesh": [["data", 2]]}
        )
        configs[step] = json.loads(config.to_json())
        checkpoint.save(mngr, step, {"x": jnp.arange(3) + step}, {"step": step, "config": config.to_json()})
    mngr.close()
    assert (
        checkpoint.saved_config(str(tmp_path))
        == configs[2]
        == {"seed": 2, "model": {"width": 16, "name": "vit"}, "mesh": [["data", 2]]}
    )
    assert checkpoint.saved_config(str(tmp_path / "checkpoints")) == configs[2]
    assert checkpoint.saved_config(str(tmp_path), step=1) == configs[1]
    assert checkpoint.saved_config(str(tmp_path / "checkpoints" / "1")) == configs[1]
    assert checkpoint.saved_config(str(tmp_path), step=3) is None
    # An unreadable newest meta: the one before.
    with open(tmp_path / "checkpoints" / "2" / "meta" / "metadata", "w") as f:
        f.write("{not json")
    assert checkpoint.saved_config(str(tmp_path)) == configs[1]


@pytest.mark.parametrize("text,named", [
    # tensorstore's error for a file it could not write (the path quoted, the errno bracketed)
    ('RESOURCE_EXHAUSTED: Error writing local file "{w}/checkpoints/500.orbax-checkpoint-tmp-1/d/abc": '
     "[OS error 28] No space left on device", "{w}/checkpoints/500.orbax-checkpoint-tmp-1/d/abc"),
    ("Failed to write {w}/plugins/profile/2026_12_05/vm.xplane.pb; No space left on device",
     "{w}/plugins/profile/2026_12_05/vm.xplane.pb"),
    ("[Errno 28] No space left on device", "a file in {w}"),  # no path in the text: the workdir
])
def test_a_full_disk_names_the_file_in_the_librarys_words(tmp_path, text, named):
    """`disk_full_write` names the file from the error's text (not the errno's '28]'), through
    the exception's causes, and the last finished checkpoint; any other error is not its business."""
    w = str(tmp_path)
    try:
        try:
            raise RuntimeError(text.format(w=w))
        except RuntimeError as inner:
            raise ValueError("the writer thread failed") from inner
    except ValueError as raised:
        err = raised
    full = checkpoint.disk_full_write(err, w)
    assert str(full) == (f"the disk is full: writing {named.format(w=w)} failed (No space left on device); no "
                         "checkpoint was saved yet; free space and rerun the same command to resume")
    os.makedirs(os.path.join(w, "checkpoints", "12"))
    assert "the last good checkpoint is step 12, kept" in str(checkpoint.disk_full_write(err, w))
    assert checkpoint.disk_full_write(RuntimeError("RESOURCE_EXHAUSTED: out of memory"), w) is None


def test_a_dataclass_state_is_saved_as_the_mapping_of_its_fields(tmp_path):
    """A trainer's state (a flax.struct dataclass) writes the checkpoint a mapping of the same
    entries writes (same metadata, same checksums; a None field, e.g. no model EMA, is no entry);
    `load_raw` reads it as that mapping, and either checkpoint restores into the dataclass."""
    from skipless_jax.trainers import common, nonfinite

    def state(as_dict: bool):
        fields = dict(step=jnp.int32(3), params={"w": jnp.arange(6.0).reshape(2, 3)}, opt_state=({"mu": jnp.ones(3)},),
                      rng=jax.random.PRNGKey(5), nonfinite=nonfinite.init_nonfinite())
        if as_dict:
            return {**fields, "nonfinite": {"count": jnp.int32(0), "first_step": jnp.int32(-1),
                                            "first_leaf": jnp.int32(-1)}}
        return common.TrainState(**fields)

    folders = {}
    for as_dict in (False, True):
        folders[as_dict] = str(tmp_path / ("dict" if as_dict else "dataclass"))
        mngr = checkpoint.manager(folders[as_dict], async_save=False)
        checkpoint.save(mngr, 3, state(as_dict), {"step": 3})
        mngr.close()
    metadata = []
    for as_dict in (False, True):
        with open(os.path.join(folders[as_dict], "checkpoints", "3", "state", "_METADATA")) as f:
            metadata.append(f.read())
    assert metadata[0] == metadata[1]
    assert checkpoint.state_entries(folders[False]) == ["nonfinite", "opt_state", "params", "rng", "step"]
    raw = checkpoint.load_raw(folders[False])[1]
    assert isinstance(raw, dict) and checkpoint.checksums(raw) == checkpoint.checksums(state(True))
    device = SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(lambda: state(False))
    target = checkpoint.abstract(abstract, jax.tree.map(lambda _: device, abstract))
    for folder in folders.values():
        mngr = checkpoint.manager(folder)
        step, restored, _ = checkpoint.restore_latest(mngr, target)
        mngr.close()
        assert step == 3 and type(restored) is common.TrainState and restored.ema is None
        assert int(restored.nonfinite.first_step) == -1
        np.testing.assert_array_equal(restored.params["w"], state(False).params["w"])
