"""Where the serving app's engine runs (actors/serving/serve_config.py ``engine_in_ingress``): resolved from the
layout and the replica counts, refused where it cannot hold, and the fused ingress's resources."""

import pytest

from actors.serving.serve_config import DeploymentOptions, ServeConfig, check_fits


def test_the_engine_is_in_the_ingress_by_default_and_apart_where_it_cannot_be():
    assert ServeConfig("m").fused
    assert ServeConfig("m", mode="disaggregated").fused           # the decode engine; prefill stays apart
    assert not ServeConfig("m", engine_in_ingress=False).fused
    assert not ServeConfig("m", parallel={"tp": 2}).fused         # a sharded replica is its own deployment
    assert not ServeConfig("m", ingress=DeploymentOptions(2, {"num_cpus": 0})).fused   # 2 ingress, 1 engine
    both = ServeConfig("m", llm=DeploymentOptions(2, {"num_cpus": 1}), ingress=DeploymentOptions(2, {"num_cpus": 0}))
    assert both.fused and both.fused_ingress().num_replicas == 2


def test_engine_in_ingress_is_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match=r"engine_in_ingress: a sharded llm replica \(parallel"):
        ServeConfig("m", engine_in_ingress=True, parallel={"tp": 2})
    with pytest.raises(ValueError, match=r"ingress.num_replicas \(2\) must equal llm.num_replicas \(1\)"):
        ServeConfig("m", engine_in_ingress=True, ingress=DeploymentOptions(2, {"num_cpus": 0}))
    with pytest.raises(ValueError, match="engine_in_ingress must be true, false or null, got 'yes'"):
        ServeConfig("m", engine_in_ingress="yes")


def test_the_fused_ingress_asks_for_the_resources_of_both():
    cfg = ServeConfig("m", llm=DeploymentOptions(1, {"num_cpus": 1, "memory": 100, "resources": {"x": 1}}),
                      ingress=DeploymentOptions(1, {"num_cpus": 0.5, "memory": 20}))
    opts = cfg.fused_ingress()
    assert dict(opts.ray_actor_options) == {"num_cpus": 1.5, "memory": 120, "resources": {"x": 1}}
    assert set(cfg.deployments()) == {"llm"}
    assert set(ServeConfig("m", mode="disaggregated").deployments()) == {"llm", "prefill"}
    assert set(ServeConfig("m", engine_in_ingress=False).deployments()) == {"llm", "ingress"}
    check_fits(cfg, 2.0, [2.0])
    with pytest.raises(ValueError, match=r"num_cpus is 1.5 but the largest Ray node has 1 CPUs"):
        check_fits(cfg, 1.0, [1.0, 1.0])


def test_jobs_serve_flag():
    from jobs.serve import make_config, parse_args

    assert make_config(parse_args(["--no-engine-in-ingress"])).engine_in_ingress is False
    assert make_config(parse_args([])).engine_in_ingress is None
