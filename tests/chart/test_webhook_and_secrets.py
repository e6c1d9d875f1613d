"""The webhook reaches only opted-in objects over verified TLS; the tierckpt CA (or the legacy token) and
the certificates are generated once and kept across upgrades (helm lookup, against the Kubernetes API
emulator); the CA's key reaches the operator only."""

from __future__ import annotations

import asyncio
import base64
import datetime
import threading
from collections.abc import Iterator

import helm_python as helm
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import padding

from tests.chart.chart_render import NAMESPACE, Rendered, render
from tierckpt.protocol.contract import Annotations, Labels


def _b64(text: str) -> bytes:
    return base64.b64decode(text)


def test_webhooks_see_only_opted_in_objects() -> None:
    mwc = render().get("MutatingWebhookConfiguration")
    hooks = {w["name"]: w for w in mwc["webhooks"]}
    assert set(hooks) == {"jobsets.tierckpt.io", "pods.tierckpt.io"}
    jobsets, pods = hooks["jobsets.tierckpt.io"], hooks["pods.tierckpt.io"]
    assert jobsets["rules"] == [
        {
            "apiGroups": ["jobset.x-k8s.io"],
            "apiVersions": ["*"],
            "operations": ["CREATE"],
            "resources": ["jobsets"],
            "scope": "Namespaced",
        }
    ]
    expression = jobsets["matchConditions"][0]["expression"]
    assert f"'{Annotations.ENABLED}'" in expression and "== 'true'" in expression
    assert pods["rules"][0]["resources"] == ["pods"] and pods["rules"][0]["operations"] == ["CREATE"]
    assert pods["objectSelector"] == {"matchLabels": {Labels.MANAGED: "true"}}
    for hook in hooks.values():
        assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
        assert hook["namespaceSelector"]["matchExpressions"] == [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", NAMESPACE]}
        ]
        assert hook["clientConfig"]["service"]["name"] == "tierckpt-webhook"
    scoped = render({"operator": {"watchNamespaces": ["ml", "research"]}})
    for hook in scoped.get("MutatingWebhookConfiguration")["webhooks"]:
        assert hook["namespaceSelector"]["matchExpressions"][1] == {
            "key": "kubernetes.io/metadata.name",
            "operator": "In",
            "values": ["ml", "research"],
        }
    env = {
        e["name"]: e.get("value")
        for e in scoped.get("Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["TIERCKPT_OPERATOR_WATCH_NAMESPACES"] == "ml,research"
    custom = render({"webhook": {"namespaceSelector": {"matchLabels": {"team": "ml"}}}})
    selector = custom.get("MutatingWebhookConfiguration")["webhooks"][1]["namespaceSelector"]
    assert selector["matchLabels"] == {"team": "ml"} and len(selector["matchExpressions"]) == 1


def _tls(r: Rendered) -> tuple[x509.Certificate, x509.Certificate, bytes]:
    secret = r.get("Secret", "tierckpt-webhook-tls")
    ca_bundle = r.get("MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["caBundle"]
    assert secret["type"] == "kubernetes.io/tls"
    assert _b64(secret["data"]["ca.crt"]) == _b64(ca_bundle)
    ca = x509.load_pem_x509_certificate(_b64(ca_bundle))
    leaf = x509.load_pem_x509_certificate(_b64(secret["data"]["tls.crt"]))
    return ca, leaf, _b64(secret["data"]["tls.key"])


def test_generated_serving_certificate_is_signed_by_the_ca_bundle_for_the_service() -> None:
    r = render()
    ca, leaf, key = _tls(r)
    ca.public_key().verify(
        leaf.signature, leaf.tbs_certificate_bytes, padding.PKCS1v15(), leaf.signature_hash_algorithm
    )
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert f"tierckpt-webhook.{NAMESPACE}.svc" in names
    assert leaf.not_valid_after_utc > datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(
        days=365
    )
    assert b"PRIVATE KEY" in key
    volumes = {v["name"]: v for v in r.get("Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["webhook-tls"]["secret"]["secretName"] == "tierckpt-webhook-tls"


def test_cert_manager_mode_issues_and_injects() -> None:
    r = render({"webhook": {"tls": {"mode": "certManager"}}})
    assert [s["metadata"]["name"] for s in r.all("Secret")] == ["tierckpt-ca"]  # no generated webhook TLS
    cert = r.get("Certificate")
    assert cert["spec"]["secretName"] == "tierckpt-webhook-tls"
    assert f"tierckpt-webhook.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"] == {"kind": "Issuer", "name": r.get("Issuer")["metadata"]["name"]}
    mwc = r.get("MutatingWebhookConfiguration")
    assert mwc["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"{NAMESPACE}/tierckpt-webhook"
    }
    assert all("caBundle" not in w["clientConfig"] for w in mwc["webhooks"])
    corp = render(
        {
            "webhook": {
                "tls": {
                    "mode": "certManager",
                    "certManager": {"issuerRef": {"kind": "ClusterIssuer", "name": "corp-ca"}},
                }
            }
        }
    )
    assert corp.all("Issuer") == [] and corp.get("Certificate")["spec"]["issuerRef"]["name"] == "corp-ca"


def test_legacy_token_is_generated_given_or_external() -> None:
    legacy = {"mode": "token"}
    generated = _b64(render({"auth": legacy}).get("Secret", "tierckpt-token")["data"]["token"])
    assert len(generated) == 48 and generated.isalnum()
    again = _b64(render({"auth": legacy}).get("Secret", "tierckpt-token")["data"]["token"])
    assert generated != again  # random per install
    given = "g" * 40
    assert (
        _b64(render({"auth": {**legacy, "token": given}}).get("Secret", "tierckpt-token")["data"]["token"])
        == given.encode()
    )
    external = render({"auth": {**legacy, "existingSecret": "corp-token"}})
    assert [s["metadata"]["name"] for s in external.all("Secret")] == ["tierckpt-webhook-tls"]
    for kind in ("DaemonSet", "Deployment"):
        volumes = {v["name"]: v for v in external.get(kind)["spec"]["template"]["spec"]["volumes"]}
        assert volumes["token"]["secret"]["secretName"] == "corp-token"


@pytest.fixture
def api_server() -> Iterator[str]:
    """The Kubernetes API emulator (tests/fixtures/k8s_emulator.py) on loopback, in a thread of its own."""
    import kmock

    from tests.fixtures.k8s_emulator import KubeEmulator

    ready, box = threading.Event(), {}

    async def serve() -> None:
        async with KubeEmulator() as emulator, kmock.Server(emulator) as server:
            box.update(url=str(server.url).rstrip("/"), loop=asyncio.get_running_loop(), stop=asyncio.Event())
            ready.set()
            await box["stop"].wait()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30), "emulator did not start"
    yield box["url"]
    box["loop"].call_soon_threadsafe(box["stop"].set)
    thread.join(10)


def _apply_secrets(url: str, r: Rendered) -> None:
    import json
    import urllib.request

    for secret in r.all("Secret"):
        req = urllib.request.Request(
            f"{url}/api/v1/namespaces/{NAMESPACE}/secrets",
            method="POST",
            data=json.dumps(secret).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 201


def test_upgrade_keeps_the_ca_the_token_and_certificates(api_server: str) -> None:
    config = helm.Config(kube_apiserver=api_server, storage_driver="memory", namespace=NAMESPACE)
    first = render(config=config)  # nothing in the cluster yet: generated
    legacy = render({"auth": {"mode": "token"}}, config=config)
    _apply_secrets(api_server, first)
    _apply_secrets(api_server, Rendered([legacy.get("Secret", "tierckpt-token")], ""))
    second = render(config=config)  # an upgrade: lookup finds them
    for name in ("tierckpt-ca", "tierckpt-webhook-tls"):
        assert second.get("Secret", name)["data"] == first.get("Secret", name)["data"]
    assert second.get("ConfigMap", "tierckpt-ca")["data"] == first.get("ConfigMap", "tierckpt-ca")["data"]
    bundle = [
        r.get("MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["caBundle"]
        for r in (first, second)
    ]
    assert bundle[0] == bundle[1]
    kept = render({"auth": {"mode": "token"}}, config=config)
    assert kept.get("Secret", "tierckpt-token")["data"] == legacy.get("Secret", "tierckpt-token")["data"]
    rotated = render({"auth": {"mode": "token", "token": "r" * 40}}, config=config)  # an explicit token wins
    assert _b64(rotated.get("Secret", "tierckpt-token")["data"]["token"]) == b"r" * 40


def test_tierckpt_ca_key_reaches_the_operator_only_and_signs_working_node_certificates(tmp_path) -> None:
    import socket
    import ssl

    from tierckpt.protocol.certs import Authority, new_key, write_identity
    from tierckpt.protocol.identity import TlsCredentials, TlsFiles, node_server_name

    r = render()
    secret, public = r.get("Secret", "tierckpt-ca"), r.get("ConfigMap", "tierckpt-ca")
    assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"tls.crt", "tls.key"}
    assert public["data"] == {"ca.crt": _b64(secret["data"]["tls.crt"]).decode()}  # the certificate alone
    ca = x509.load_pem_x509_certificate(_b64(secret["data"]["tls.crt"]))
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    mounted = {
        kind: [
            v.get("secret", {}).get("secretName") for v in r.get(kind)["spec"]["template"]["spec"]["volumes"]
        ]
        for kind in ("Deployment", "DaemonSet")
    }
    assert "tierckpt-ca" in mounted["Deployment"] and "tierckpt-ca" not in mounted["DaemonSet"]
    # the operator loads the chart's CA (helm makes RSA keys) and its node certificates work
    (tmp_path / "tls.crt").write_bytes(_b64(secret["data"]["tls.crt"]))
    (tmp_path / "tls.key").write_bytes(_b64(secret["data"]["tls.key"]))
    (tmp_path / "ca.crt").write_text(public["data"]["ca.crt"])
    authority = Authority.load(tmp_path / "tls.crt", tmp_path / "tls.key")
    for name in ("a", "b"):
        key = new_key()
        cert = authority.node_certificate(key.public_key(), name, datetime.timedelta(hours=1))
        write_identity(tmp_path / f"{name}.pem", key, cert)
    a, b = (TlsCredentials(TlsFiles(tmp_path / f"{n}.pem", tmp_path / "ca.crt")) for n in ("a", "b"))
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        thread = threading.Thread(
            target=lambda: a.server().wrap_socket(server.accept()[0], server_side=True).close(), daemon=True
        )
        thread.start()
        with b.client(named=True).wrap_socket(
            socket.create_connection(("127.0.0.1", port)), server_hostname=node_server_name("a")
        ) as tls:
            assert tls.version() == "TLSv1.3" and isinstance(tls, ssl.SSLSocket)
        thread.join(5)


def test_cert_manager_issues_the_tierckpt_ca_and_the_operator_publishes_it() -> None:
    r = render({"tls": {"mode": "certManager"}})
    cert = r.get("Certificate", "tierckpt-ca")
    assert cert["spec"]["isCA"] is True and cert["spec"]["secretName"] == "tierckpt-ca"
    assert cert["spec"]["issuerRef"] == {"kind": "Issuer", "name": "tierckpt-ca-selfsigned"}
    assert r.all("ConfigMap") == [] and "tierckpt-ca" not in [s["metadata"]["name"] for s in r.all("Secret")]
    env = {
        e["name"]: e.get("value")
        for e in r.get("Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["TIERCKPT_OPERATOR_CA_CONFIGMAP"] == "tierckpt-ca"
    corp = render(
        {
            "tls": {
                "mode": "certManager",
                "certManager": {"issuerRef": {"kind": "ClusterIssuer", "name": "corp"}},
            }
        }
    )
    assert corp.get("Certificate", "tierckpt-ca")["spec"]["issuerRef"] == {
        "kind": "ClusterIssuer",
        "name": "corp",
    }
    assert [i["metadata"]["name"] for i in corp.all("Issuer")] == []


def test_monitors_select_services_by_labels_and_existing_ports() -> None:
    r = render(
        {
            "metrics": {
                "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                "podMonitoring": {"enabled": True},
            }
        }
    )
    for monitor in r.all("ServiceMonitor"):
        assert monitor["metadata"]["labels"]["release"] == "prom"
        services = [
            s
            for s in r.all("Service")
            if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
        ]
        assert len(services) == 1
        ports = {p["name"] for p in services[0]["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
        assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
    for monitor in r.all("PodMonitoring"):
        component = monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        workload = r.get("DaemonSet" if component == "replicator" else "Deployment")
        pod = workload["spec"]["template"]["spec"]
        declared = {
            p["name"] for c in pod.get("initContainers", []) + pod["containers"] for p in c.get("ports", [])
        }
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= declared
    assert len(r.all("ServiceMonitor")) == len(r.all("PodMonitoring")) == 2
