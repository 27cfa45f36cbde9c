"""JAX's private names that nnxscale relies on, each called as nnxscale calls it.

A JAX release that moves one fails here by name (and nnxscale itself says which, in one
line, instead of an ImportError deep in a job)."""

import jax
import pytest

from nnxscale.jobs import jax_private
from nnxscale.errors import JaxVersionError, NnxscaleError


def test_after_a_reset_jax_reads_whether_its_compilation_cache_is_on_again(tmp_path):
    """JAX decides once whether its persistent cache is in use; nnxscale turns it off in a CPU
    job of several processes (jobs.distributed) and resets it so that JAX asks again. Here:
    on, a new program's entry is written to the cache; off and reset, the next one's is not;
    on and reset again, it is."""
    names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")  # fmt: skip
    kept = {name: getattr(jax.config, name) for name in names}

    def entries_after_compiling(scale: float) -> int:
        jax.jit(lambda x: x * scale + 1.0).lower(jax.numpy.ones(3)).compile()  # a new program each time
        return len(list(tmp_path.iterdir()))

    try:
        for name, value in zip(names, (True, str(tmp_path), 0.0, 0)):
            jax.config.update(name, value)
        jax_private.reset_compilation_cache()
        on = entries_after_compiling(2.0)
        jax.config.update("jax_enable_compilation_cache", False)
        jax_private.reset_compilation_cache()
        off = entries_after_compiling(3.0)
        jax.config.update("jax_enable_compilation_cache", True)
        jax_private.reset_compilation_cache()
        on_again = entries_after_compiling(4.0)
    finally:
        for name, value in kept.items():
            jax.config.update(name, value)
        jax_private.reset_compilation_cache()
    assert on >= 1 and off == on and on_again > off, (on, off, on_again)


def test_jax_lists_its_cluster_environments():
    names = {env.__name__ for env in jax_private.cluster_types()}
    # JAX's own detectors for the launchers docs/multiprocess.md names.
    assert {"SlurmCluster", "OmpiCluster"} <= names, names
    for env in jax_private.cluster_types():
        assert callable(env.is_env_present) and isinstance(env.opt_in_only_method, bool)


def test_the_distributed_client_is_none_before_a_job():
    assert jax_private.distributed_client() is None  # no jax.distributed.initialize in this process


def test_jax_says_whether_its_backend_started():
    jax.devices()
    assert jax_private.backends_are_initialized() is True


def test_xla_counts_the_flops_of_an_optimized_module():
    x = jax.ShapeDtypeStruct((64, 32), jax.numpy.float32)
    compiled = jax.jit(lambda a, b: a @ b.T).lower(x, x).compile()
    (module,) = compiled.runtime_executable().hlo_modules()
    assert jax_private.hlo_cost_analysis(module)["flops"] == 2 * 64 * 64 * 32  # the matmul's multiply-adds


def test_the_cudnn_version_is_a_number_or_none():
    version = jax_private.cudnn_version()  # None without nvidia-cudnn-cu12 (the CPU-only install)
    assert version is None or (isinstance(version, int) and version >= 8000)


def test_a_name_jax_dropped_is_one_error_naming_it():
    with pytest.raises(JaxVersionError, match=r"jax \S+ has no jax\._src\.clusters\.ClusterEnv\._gone, which nnxscale uses to test"):
        jax_private._private("clusters", "ClusterEnv", "_gone", used_for="to test")
    with pytest.raises(NnxscaleError, match=r"has no jax\._src\.no_such_module"):
        jax_private._private("no_such_module", used_for="to test")
