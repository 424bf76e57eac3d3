"""The pieces that take Tandem beyond one machine, without a network: NATS configuration for a
cluster and TLS, the stack's own CA, URL lists, replica detection, connect files and worker ids of
joined hosts. (The stack on a real cluster: tests/integration/test_nats_cluster.py; across
network namespaces: tests/integration/test_hosts.py.)"""

import socket
import ssl
import threading

import pytest

from services.join.service import read_connect_file, spec_from_settings
from services.up.service import spec_from_settings as up_spec
from shared.bus.bus import detect_replicas, server_urls
from services.framework.errors import CliError
from services.cli import build_parser
from services.stack.servers import NatsCluster, nats_config
from services.framework.command import settings_from_args
from services.stack.stack import Stack, StackSpec
from services.stack.tls import server_tls
from shared.telemetry.redact import redact_url


def test_a_url_setting_names_one_server_or_every_member_of_a_cluster():
    assert server_urls("nats://a:1") == ["nats://a:1"]
    assert server_urls("tls://u:p@a:1, tls://u:p@b:2,") == ["tls://u:p@a:1", "tls://u:p@b:2"]
    with pytest.raises(ValueError):
        server_urls(" , ")
    assert redact_url("nats://u:pw@a:1,nats://u:pw@b:2") == "nats://u:***@a:1,nats://u:***@b:2"


def test_replicas_follow_the_cluster_the_server_names():
    assert detect_replicas({}) == 1
    assert detect_replicas({"cluster": "c", "connect_urls": ["a:1"]}) == 1
    assert detect_replicas({"cluster": "c", "connect_urls": ["a:1", "b:1"]}) == 2
    assert detect_replicas({"cluster": "c", "connect_urls": ["a:1", "b:1", "c:1", "d:1", "e:1"]}) == 3


def test_a_cluster_members_config_routes_to_every_member_with_the_route_login(tmp_path):
    text = nats_config(server_name="nats-2", host="10.0.0.2", port=4222, store_dir=tmp_path, user="tandem",
                       password="pw", http_port=8222, advertise="10.0.0.2",
                       cluster=NatsCluster("tandem", "10.0.0.2:6222", ["nats://10.0.0.1:6222", "nats://10.0.0.2:6222"],
                                           route_password="rpw"))
    assert 'listen: "10.0.0.2:4222"' in text and 'client_advertise: "10.0.0.2:4222"' in text
    assert 'server_name: "nats-2"' in text and 'http: "127.0.0.1:8222"' in text
    assert 'routes: ["nats://route:rpw@10.0.0.1:6222", "nats://route:rpw@10.0.0.2:6222"]' in text
    assert 'authorization { user: "route", password: "rpw" }' in text
    assert 'authorization { user: "tandem", password: "pw" }' in text
    assert "tls" not in text


def test_the_stacks_ca_signs_a_certificate_clients_verify_for_each_name(tmp_path):
    tls = server_tls(tmp_path, ["127.0.0.1", "localhost"])
    assert tls.key_file.stat().st_mode & 0o077 == 0 and (tmp_path / "ca-key.pem").stat().st_mode & 0o077 == 0
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(tls.cert_file, tls.key_file)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve(n: int) -> None:
        for _ in range(n):
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls_conn:
                    tls_conn.recv(1)
            except (ssl.SSLError, OSError):
                pass

    thread = threading.Thread(target=serve, args=(3,), daemon=True)
    thread.start()
    trusting = ssl.create_default_context(cafile=str(tls.ca_file))
    for name in ("127.0.0.1", "localhost"):
        with socket.create_connection(("127.0.0.1", port)) as raw, \
                trusting.wrap_socket(raw, server_hostname=name) as conn:
            conn.sendall(b"x")
    with socket.create_connection(("127.0.0.1", port)) as raw:  # a name the certificate does not carry
        with pytest.raises(ssl.SSLCertVerificationError):
            trusting.wrap_socket(raw, server_hostname="elsewhere.example")
    thread.join(5)
    listener.close()
    ca = tls.ca_file.read_bytes()
    assert server_tls(tmp_path, ["127.0.0.1"]).ca_file.read_bytes() == ca  # kept: joined hosts still trust it


def test_join_reads_the_connect_file_and_finds_the_ca_beside_it(tmp_path):
    connect = tmp_path / "connect.env"
    connect.write_text("# written by tandem up\nTANDEM_NATS_URL=tls://tandem:pw@10.0.0.1:4222\n"
                       "TANDEM_NAMESPACE=prod\nTANDEM_REGISTRY_TTL_S=3\nTANDEM_NATS_CA=/elsewhere/ca.pem\n"
                       "TANDEM_NATS_REPLICAS=3\n")
    with pytest.raises(CliError, match="not on this host"):
        read_connect_file(connect)
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    values = read_connect_file(connect)
    assert values["TANDEM_NATS_CA"] == str(tmp_path / "ca.pem")
    args = build_parser().parse_args(["join", "--connect", str(connect), "--decode", "2", "--prefill", "1",
                                      "--host-name", "gpu7", "--state-dir", str(tmp_path)])
    spec = spec_from_settings(settings_from_args(args.settings_class, args), values)
    assert (spec.control_plane, spec.namespace, spec.nats_replicas, spec.registry_ttl_s) == (False, "prod", 3, 3.0)
    assert (spec.num_decode, spec.num_prefill, spec.nats_url) == (2, 1, "tls://tandem:pw@10.0.0.1:4222")
    assert Stack(spec).worker_id("decode-1") == "prod-gpu7-decode-1"
    assert Stack(StackSpec(state_dir=tmp_path, namespace="prod")).worker_id("decode-1") == "prod-decode-1"
    assert Stack(spec)._metrics_flags() == {"metrics_port": 0}  # the services' default: loopback


def test_metrics_host_reaches_every_child_of_up_and_join(tmp_path):
    connect = tmp_path / "connect.env"
    connect.write_text("TANDEM_NATS_URL=nats://tandem:pw@10.0.0.1:4222\n")
    for argv in (["join", "--connect", str(connect), "--state-dir", str(tmp_path)], ["up"]):
        args = build_parser().parse_args([*argv, "--metrics-host", "0.0.0.0"])
        settings = settings_from_args(args.settings_class, args)
        spec = spec_from_settings(settings, read_connect_file(connect)) if argv[0] == "join" else up_spec(settings)
        assert Stack(spec)._metrics_flags() == {"metrics_port": 0, "metrics_host": "0.0.0.0"}, argv[0]


@pytest.mark.parametrize("text, why", [("TANDEM_NAMESPACE=x\n", "no TANDEM_NATS_URL"),
                                        ("TANDEM_NATS_URL=nats://a:1\nTANDEM_SECRET=1\n", "expected one of")])
def test_a_bad_connect_file_is_one_clear_error(tmp_path, text, why):
    connect = tmp_path / "connect.env"
    connect.write_text(text)
    with pytest.raises(CliError, match=why):
        read_connect_file(connect)
    with pytest.raises(CliError, match="cannot read"):
        read_connect_file(tmp_path / "missing.env")


def test_up_refuses_cluster_and_tls_flags_for_a_nats_it_does_not_run():
    args = build_parser().parse_args(["up", "--nats-url", "nats://a:1", "--nats-cluster", "3"])
    with pytest.raises(CliError, match="nats_cluster and nats_tls"):
        settings_from_args(args.settings_class, args)


def test_a_joined_hosts_stack_speaks_as_join(tmp_path):
    assert Stack(StackSpec(tmp_path, control_plane=False)).label == "join"
    assert Stack(StackSpec(tmp_path)).label == "up"


def _join_spec(tmp_path, *flags: str):
    connect = tmp_path / "connect.env"
    connect.write_text("TANDEM_NATS_URL=nats://tandem:pw@10.0.0.1:4222\n")
    args = build_parser().parse_args(["join", "--connect", str(connect), "--state-dir", str(tmp_path), *flags])
    return spec_from_settings(settings_from_args(args.settings_class, args), read_connect_file(connect))


def test_a_parallel_worker_spans_two_joined_hosts(tmp_path):
    """Host A leads two TP=2 decode workers, each with one rank of its own and a port of its own;
    host B runs their rank 1s (``tandem rank`` children, restarted whenever their group ends)."""
    a = _join_spec(tmp_path, "--decode", "2", "--prefill", "1", "--decode-tp", "2", "--group-local-ranks", "1",
                   "--group-host", "10.0.0.2", "--group-port", "29650")
    assert a.worker_flags == {f"decode-{i + 1}": {"group_local_ranks": 1, "group_host": "10.0.0.2",
                                                  "group_port": 29650 + i} for i in range(2)}  # prefill: TP=1
    assert a.rank_flags == {}
    b = _join_spec(tmp_path, "--group-join", "10.0.0.2:29650")
    assert (b.num_decode, b.num_prefill) == (0, 0)  # ranks only: no worker of its own
    assert b.rank_flags == {"rank-1": {"join": "10.0.0.2:29650", "rank": 1, "log_level": "INFO"}}
    from services.stack.children import service_argv

    assert service_argv("rank", b.rank_flags["rank-1"])[-7:] == ["rank", "--join", "10.0.0.2:29650", "--rank", "1",
                                                                  "--log-level", "INFO"]
    assert build_parser().parse_args(["rank", "--join", "10.0.0.2:29650", "--rank", "1"]).size is None
    three = _join_spec(tmp_path, "--group-join", "10.0.0.2:29650", "--group-rank", "2", "--group-ranks", "2",
                       "--decode", "1")
    assert (three.num_decode, sorted(three.rank_flags)) == (1, ["rank-2", "rank-3"])
    with pytest.raises(CliError, match="give --group-host"):
        _join_spec(tmp_path, "--decode-tp", "2", "--group-local-ranks", "1")


def test_a_plan_over_two_nodes_runs_as_tandem_up_on_one_and_tandem_join_on_the_other(tmp_path, plan_file):
    """d1's two pipeline stages sit on nodes a and b: a leads it at its group port, b runs its rank 1."""
    from services.up.service import spec_from_settings as up_spec

    path = plan_file([("d0", "decode", ["a/gpu0"], 1, 1), ("d1", "decode", ["a/gpu1", "b/gpu0"], 1, 2),
                      ("p0", "prefill", ["b/gpu1"], 1, 1)])
    plan_flags = ["--plan", str(path), "--device", "cpu", "--group-port", "29700"]
    args = build_parser().parse_args(["up", *plan_flags, "--plan-node", "a", "--group-host", "10.0.0.1"])
    a = up_spec(settings_from_args(args.settings_class, args))
    assert (a.num_decode, a.num_prefill, a.rank_flags) == (2, 0, {})
    assert a.worker_flags == {"decode-1": {}, "decode-2": {"pipeline_parallel_size": 2, "group_local_ranks": 1,
                                                           "group_host": "10.0.0.1", "group_port": 29700}}
    b = _join_spec(tmp_path, *plan_flags, "--plan-node", "b", "--plan-leaders", "a=10.0.0.1")
    assert (b.num_decode, b.num_prefill, b.worker_flags) == (0, 1, {"prefill-1": {}})
    assert b.rank_flags == {"rank-d1-1": {"join": "10.0.0.1:29700", "rank": 1, "log_level": "INFO"}}
    with pytest.raises(CliError, match="give its address with --plan-leaders a=ADDRESS"):
        _join_spec(tmp_path, *plan_flags, "--plan-node", "b")
