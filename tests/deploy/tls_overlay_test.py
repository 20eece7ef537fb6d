"""deploy/kubernetes-tls, the TLS overlay of the Kubernetes manifests, rendered and run.

The overlay's JSON 6902 operations are applied to the base Deployment here (and, where kubectl
is installed, checked against `kubectl kustomize`'s rendering). Then:
  - statically: no probe is left a native gRPC probe (the kubelet's cannot speak TLS); every
    probe runs the image's moe-cli against the gRPC port, checks the certificate against the
    CA in the mounted Secret and against the Service's cluster DNS name; readiness asks for the
    proto's service; the --tls_ files lie in that Secret's mount;
  - live: moe-server starts with the rendered flags (moved to loopback and the CPU, the Secret's
    mount played by a directory holding the test PKI as tls.crt, tls.key and ca.crt), and each
    probe's own command line succeeds against it; the same commands fail against the plaintext
    server the base manifests run, and against this one when ca.crt is another CA, so a probe
    that passes means TLS works as configured.

Usage: tls_overlay_test.py --repo ROOT --server BIN --cli BIN
"""

import argparse
import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

from live_monitoring_test import TestFailure, free_ports, wait_for

OVERLAY = "deploy/kubernetes-tls"
BASE = "deploy/kubernetes"
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")
IMAGE_CLI = "/opt/moe/bin/moe-cli"


def load(repo, rel):
    with open(os.path.join(repo, rel)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def apply_json_patch(doc, ops):
    """The two JSON 6902 operations the overlay uses: add (a key, or "-" to append to a list)
    and replace."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if op["op"] == "add" and isinstance(node, list):
            if last == "-":
                node.append(copy.deepcopy(op["value"]))
            else:
                node.insert(int(last), copy.deepcopy(op["value"]))
        elif op["op"] in ("add", "replace"):
            if op["op"] == "replace" and last not in node:
                raise TestFailure(f"replace of {op['path']}, which the base does not have")
            node[int(last) if isinstance(node, list) else last] = copy.deepcopy(op["value"])
        else:
            raise TestFailure(f"unexpected operation {op['op']} in the overlay")
    return doc


def render(repo):
    """The overlay's Deployment, and the base objects it applies to."""
    (kust,) = load(repo, f"{OVERLAY}/kustomization.yaml")
    if kust.get("resources") != ["../kubernetes"]:
        raise TestFailure(f"the overlay's resources are {kust.get('resources')}, not the base")
    (patch,) = kust["patches"]
    if patch["target"] != {"kind": "Deployment", "name": "moe-server"}:
        raise TestFailure(f"the overlay patches {patch['target']}, not the moe-server Deployment")
    (ops,) = load(repo, f"{OVERLAY}/{patch['path']}")
    (base_kust,) = load(repo, f"{BASE}/kustomization.yaml")
    objs = []
    for res in base_kust["resources"]:
        objs += load(repo, f"{BASE}/{res}")
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    rendered = apply_json_patch(dep, ops)
    if shutil.which("kubectl"):
        p = subprocess.run(["kubectl", "kustomize", os.path.join(repo, OVERLAY)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise TestFailure(f"kubectl kustomize {OVERLAY}:\n{p.stderr}")
        (theirs,) = [o for o in yaml.safe_load_all(p.stdout) if o and o["kind"] == "Deployment"]
        def pod(d):  # the image's tag is the base kustomization's images: entry, not ours
            spec = copy.deepcopy(d["spec"]["template"]["spec"])
            for c in spec["containers"]:
                c.pop("image")
            return spec
        if pod(theirs) != pod(rendered):
            raise TestFailure("kubectl kustomize renders a different pod spec than the patch here")
        print("ok: kubectl kustomize renders the same pod spec")
    return rendered, objs, base_kust["namespace"]


def check_static(repo, dep, objs, namespace):
    spec = dep["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "moe-server"]
    args = dict(a[2:].split("=", 1) for a in c["args"] if a.startswith("--"))
    grpc_port = {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}

    def secret_mount(file):
        mount = os.path.dirname(file)
        volume = volumes.get(mounts.get(mount, ""), {})
        if "secret" not in volume:
            raise TestFailure(f"{file} is not in a mounted Secret")
        return mount

    mount = {secret_mount(args[f]) for f in ("tls_cert_file", "tls_key_file")}
    if len(mount) != 1:
        raise TestFailure(f"the certificate and key come from different mounts {mount}")
    (svc,) = [o for o in objs if o["kind"] == "Service"
              and any(p["targetPort"] == "grpc" for p in o["spec"]["ports"])]
    dns_name = f"{svc['metadata']['name']}.{namespace}.svc"
    with open(os.path.join(repo, "proto/moe/v1/moe.proto")) as f:
        proto = f.read()
    package = re.search(r"^package\s+([\w.]+);", proto, re.M).group(1)
    services = {f"{package}.{s}" for s in re.findall(r"^service\s+(\w+)", proto, re.M)}
    for probe in PROBES:
        p = c[probe]
        if "grpc" in p or "exec" not in p:
            raise TestFailure(f"{probe} is not an exec probe: {p}")
        cmd = p["exec"]["command"]
        flags = dict(a[2:].split("=", 1) for a in cmd if a.startswith("--"))
        positional = [a for a in cmd[1:] if not a.startswith("--")]
        if cmd[0] != IMAGE_CLI:
            raise TestFailure(f"{probe} runs {cmd[0]}, not the image's {IMAGE_CLI}")
        if flags.get("server") != f"localhost:{grpc_port}":
            raise TestFailure(f"{probe} dials {flags.get('server')}, not the gRPC port {grpc_port}")
        if secret_mount(flags.get("tls_ca_file", "")) not in mount:
            raise TestFailure(f"{probe}'s CA is not in the certificate's Secret")
        if flags.get("tls_server_name") != dns_name:
            raise TestFailure(f"{probe} checks the name {flags.get('tls_server_name')}, "
                              f"not the Service's {dns_name}")
        if float(flags.get("timeout_seconds", "10")) >= p.get("timeoutSeconds", 1):
            raise TestFailure(f"{probe}'s call deadline does not end before the probe's timeout")
        if positional[0] != "health" or (probe == "readinessProbe") != (positional[1:] != []):
            raise TestFailure(f"{probe} runs {positional}")
        if positional[1:] and positional[1] not in services:
            raise TestFailure(f"readinessProbe asks for {positional[1]}, not a proto service")
    with open(os.path.join(repo, "scripts/stage-runtime")) as f:
        if "moe-cli" not in re.search(r"^required=\((.*)\)", f.read(), re.M).group(1):
            raise TestFailure("the image does not always hold moe-cli, which the probes run")
    print(f"ok: every probe runs moe-cli over TLS against {dns_name} on port {grpc_port}")
    return c, mount.pop()


def run(args):
    repo = os.path.abspath(args.repo)
    tmp = tempfile.mkdtemp(prefix="moe-deploy-tls-")
    procs = []
    try:
        dep, objs, namespace = render(repo)
        c, mount = check_static(repo, dep, objs, namespace)
        pki = os.path.join(repo, "tests/testdata/tls")
        secret = os.path.join(tmp, "secret")
        os.makedirs(secret)
        for name, src in (("tls.crt", "server.pem"), ("tls.key", "server-key.pem"),
                          ("ca.crt", "ca.pem")):
            shutil.copy(os.path.join(pki, src), os.path.join(secret, name))
        grpc_port = str({p["name"]: p["containerPort"] for p in c["ports"]}["grpc"])

        tokens = os.path.join(tmp, "tokens")
        with open(tokens, "w") as f:
            f.write("moe-admin " + os.urandom(16).hex() + "\n")

        def start(argv, port, metrics_port, name):
            if not any(a.startswith("--tokens_file=") for a in argv):
                raise TestFailure(f"the {name} manifests run moe-server without --tokens_file")
            ckpt = os.path.join(tmp, f"checkpoints-{name}")
            os.makedirs(ckpt)
            override = {"host": "127.0.0.1", "metrics_host": "127.0.0.1", "port": str(port),
                        "metrics_port": str(metrics_port), "device": "cpu",
                        "checkpoint_dir": ckpt, "tokens_file": tokens}
            argv = [a.replace(mount, secret) for a in argv
                    if a[2:].split("=", 1)[0] not in override]
            argv += [f"--{k}={v}" for k, v in override.items()]
            log = open(os.path.join(tmp, f"{name}.log"), "w+")
            p = subprocess.Popen([args.server] + argv, stdout=log, stderr=subprocess.STDOUT)
            procs.append((name, p))
            return p

        def probe(name, port, ca="ca.crt"):
            cmd = [args.cli if a == c[name]["exec"]["command"][0] else
                   a.replace(mount + "/ca.crt", os.path.join(secret, ca))
                    .replace(f"localhost:{grpc_port}", f"localhost:{port}")
                   for a in c[name]["exec"]["command"]]
            return subprocess.run(cmd, capture_output=True, text=True)

        tls_port, tls_metrics, plain_port, plain_metrics = free_ports(4)
        start(c["args"], tls_port, tls_metrics, "tls")
        wait_for("the startup probe", lambda: probe("startupProbe", tls_port).returncode == 0,
                 60, procs)
        for name in PROBES:
            p = probe(name, tls_port)
            if p.returncode != 0:
                raise TestFailure(f"{name} fails against the TLS server: {p.stdout}{p.stderr}")
        print("ok: the three probes pass against moe-server run with the overlay's flags")

        shutil.copy(os.path.join(pki, "other-ca.pem"), os.path.join(secret, "other-ca.crt"))
        for name in PROBES:
            p = probe(name, tls_port, ca="other-ca.crt")
            if p.returncode == 0:
                raise TestFailure(f"{name} passes with a CA that did not sign the certificate")
        (base,) = [o for o in load(repo, f"{BASE}/deployment.yaml") if o["kind"] == "Deployment"]
        start(base["spec"]["template"]["spec"]["containers"][0]["args"], plain_port,
              plain_metrics, "plaintext")
        wait_for("the plaintext server", lambda: subprocess.run(
            [args.cli, f"--server=127.0.0.1:{plain_port}", "health"],
            capture_output=True).returncode == 0, 60, procs)
        for name in PROBES:
            p = probe(name, plain_port)
            if p.returncode == 0:
                raise TestFailure(f"{name} passes against a plaintext server")
        print("ok: the probes fail with another CA and against a plaintext server")
        return 0
    except TestFailure as e:
        print(f"FAIL: {e}", file=sys.stderr)
        for f in sorted(os.listdir(tmp)):
            if f.endswith(".log"):
                with open(os.path.join(tmp, f)) as log:
                    print(f"--- {f}\n{log.read()[-3000:]}", file=sys.stderr)
        return 1
    finally:
        for _, p in procs:
            p.terminate()
        for _, p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--cli", required=True)
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
