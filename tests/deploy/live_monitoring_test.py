"""A real Prometheus watching a real moe-server through a short training run.

Starts moe-server on loopback (random free ports, --device=cpu, its tokens file a temporary one
naming the driver's principal, the remaining flags taken from the Kubernetes Deployment so that
they are known to be accepted), checks the grpc.health.v1 answers the manifests' probes rely on
(without a token), starts Debian's Prometheus as a subprocess with a temporary config (1 s
scrapes, the shipped alert rules), runs training_driver with the token (which first checks that
a connection without one is refused: authentication is on), and then asks Prometheus's HTTP API:
  - the forward and backward token rates are non-zero, and so is the optimizer step rate;
  - the context the driver abandoned is counted as dropped when its session closed;
  - every metric (and label, and literal label value) that the alert rules and the Grafana
    dashboard use is in a live scrape of /metrics; every dashboard query runs and
    returns data;
  - every alert rule evaluates without error;
  - after the server is stopped (SIGTERM, which must exit cleanly), MoeServerDown goes pending.

Usage: live_monitoring_test.py --repo ROOT --server BIN --driver BIN --probe BIN
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

import promql

# Labels Prometheus attaches to every target, not exported by the server.
TARGET_LABELS = {"job", "instance"}


class TestFailure(Exception):
    pass


def free_ports(n):
    """n distinct free loopback ports: every socket stays bound until all are known (one bound
    and closed at a time may hand out the same port twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def wait_for(what, fn, timeout, procs=()):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        for name, p in procs:
            if p.poll() is not None:
                raise TestFailure(f"{name} exited with {p.returncode} while waiting for {what}")
        try:
            result = fn()
            if result:
                return result
        except Exception as e:  # the service is not up yet
            last = e
        time.sleep(0.25)
    raise TestFailure(f"timed out after {timeout}s waiting for {what} (last error: {last})")


class Prometheus:
    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}"

    def api(self, endpoint, **params):
        url = f"{self.base}/api/v1/{endpoint}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        status, body = http_get(url)
        data = json.loads(body)
        if data.get("status") != "success":
            raise TestFailure(f"{endpoint} {params}: {data}")
        return data["data"]

    def query(self, expr):
        data = self.api("query", query=expr)
        return data["result"]

    def scalar(self, expr):
        res = self.query(expr)
        if len(res) != 1:
            raise TestFailure(f"{expr} returned {len(res)} series, expected 1: {res}")
        return float(res[0]["value"][1])


def parse_exposition(text):
    """Prometheus text format -> {series name: [label dict, ...]}."""
    series = {}
    line_re = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+\S+')
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.split("\n"):
        if not line or line.startswith("#"):
            continue
        m = line_re.match(line)
        if not m:
            raise TestFailure(f"unparseable exposition line: {line!r}")
        labels = dict(label_re.findall(m.group(3) or ""))
        series.setdefault(m.group(1), []).append(labels)
    return series


def server_flags(server):
    p = subprocess.run([server, "--helpfull"], capture_output=True, text=True)
    flags = set(re.findall(r"^\s+--([A-Za-z0-9_]+) \(", p.stdout + p.stderr, re.M))
    if "port" not in flags:
        raise TestFailure(f"could not read moe-server's flags from --helpfull:\n{p.stdout}{p.stderr}")
    return flags


def shipped_server_args(repo):
    """Every moe-server command line the deployment files ship, by file."""
    out = {}
    for rel in ("deploy/kubernetes/deployment.yaml", "deploy/kubernetes-shards/statefulset.yaml"):
        with open(os.path.join(repo, rel)) as f:
            pod = yaml.safe_load(f)["spec"]["template"]["spec"]
        (c,) = [c for c in pod["containers"] if c["name"] == "moe-server"]
        out[rel] = c["args"]
    with open(os.path.join(repo, "docker/compose.yaml")) as f:
        out["docker/compose.yaml"] = yaml.safe_load(f)["services"]["moe-server"]["command"]
    with open(os.path.join(repo, "docker/Dockerfile")) as f:
        out["docker/Dockerfile"] = json.loads(re.search(r"^CMD\s+(\[.*\])", f.read(), re.M).group(1))
    return out


def used_queries(repo):
    """(where, PromQL) for every alert rule and every dashboard query and variable."""
    out = []
    with open(os.path.join(repo, "deploy/prometheus/alerts.yaml")) as f:
        for g in yaml.safe_load(f)["groups"]:
            for r in g["rules"]:
                out.append((f"alert {r.get('alert') or r.get('record')}", r["expr"]))
    with open(os.path.join(repo, "deploy/grafana/moe-offload.json")) as f:
        dash = json.load(f)
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r}", t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.match(r"label_values\((.*),\s*(\w+)\)$", q)
            out.append((f"variable ${v['name']}", m.group(1) if m else q))
    return out, dash


def grafana_to_promql(expr):
    """Substitutes the dashboard's variables the way Grafana would with 'All' selected."""
    expr = expr.replace("$__rate_interval", "1m")
    return re.sub(r"\$\{?(instance|layer)\}?", ".*", expr)


def run(args):
    repo = os.path.abspath(args.repo)
    tmp = tempfile.mkdtemp(prefix="moe-deploy-live-")
    procs = []
    logs = {}

    def start(name, cmd):
        log = open(os.path.join(tmp, f"{name}.log"), "w+")
        logs[name] = log
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        procs.append((name, p))
        return p

    try:
        # 1. The flags every shipped command line uses are flags moe-server has.
        flags = server_flags(args.server)
        for where, argv in shipped_server_args(repo).items():
            for a in argv:
                name = a[2:].split("=", 1)[0]
                if not a.startswith("--") or name not in flags:
                    raise TestFailure(f"{where} passes {a!r}, which moe-server does not accept")
        print(f"ok: shipped command lines use only moe-server flags ({len(flags)} known)")

        # 2. moe-server with the Deployment's own flags, moved to loopback and the CPU.
        grpc_port, metrics_port, prom_port = free_ports(3)
        ckpt = os.path.join(tmp, "checkpoints")
        os.makedirs(ckpt)
        tokens = os.path.join(tmp, "tokens")
        token = "deploy-trainer-" + os.urandom(16).hex()
        with open(tokens, "w") as f:
            f.write(f"deploy-trainer {token}\n")
        token_file = os.path.join(tmp, "token")
        with open(token_file, "w") as f:
            f.write(token + "\n")
        override = {"host": "127.0.0.1", "metrics_host": "127.0.0.1", "port": str(grpc_port),
                    "metrics_port": str(metrics_port), "device": "cpu", "checkpoint_dir": ckpt,
                    "tokens_file": tokens}
        shipped = shipped_server_args(repo)["deploy/kubernetes/deployment.yaml"]
        if not any(a.startswith("--tokens_file=") for a in shipped):
            raise TestFailure("the Deployment runs moe-server without --tokens_file: "
                              "authentication is off")
        argv = [a for a in shipped if a[2:].split("=", 1)[0] not in override]
        argv += [f"--{k}={v}" for k, v in override.items()]
        server = start("moe-server", [args.server] + argv)
        target = f"127.0.0.1:{grpc_port}"
        wait_for("moe-server health", lambda: subprocess.run(
            [args.probe, target], capture_output=True).returncode == 0, 60, procs)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        wait_for("moe-server /metrics", lambda: http_get(metrics_url)[0] == 200, 30, procs)

        # 3. The probes the manifests configure succeed, and a probe of an unknown service fails.
        with open(os.path.join(repo, "deploy/kubernetes/deployment.yaml")) as f:
            c = yaml.safe_load(f)["spec"]["template"]["spec"]["containers"][0]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            service = c[probe]["grpc"].get("service", "")
            p = subprocess.run([args.probe, target, service], capture_output=True, text=True)
            if p.returncode != 0:
                raise TestFailure(f"{probe} (service {service!r}) fails: {p.stdout}{p.stderr}")
        p = subprocess.run([args.probe, target, "no.such.Service"], capture_output=True, text=True)
        if p.returncode == 0:
            raise TestFailure("the health probe reports SERVING for a service that does not exist")
        print("ok: grpc.health.v1 answers the startup, liveness and readiness probes")

        # 4. Prometheus scraping it every second, with the shipped rules.
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [os.path.join(repo, "deploy/prometheus/alerts.yaml")],
            "scrape_configs": [{"job_name": "moe-server",
                                "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}],
        }
        config_path = os.path.join(tmp, "prometheus.yml")
        with open(config_path, "w") as f:
            yaml.safe_dump(config, f)
        start("prometheus", ["prometheus", f"--config.file={config_path}",
                             f"--storage.tsdb.path={os.path.join(tmp, 'tsdb')}",
                             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"])
        prom = Prometheus(prom_port)
        wait_for("Prometheus ready", lambda: http_get(f"{prom.base}/-/ready")[0] == 200, 60, procs)
        wait_for("a successful scrape of moe-server",
                 lambda: prom.query('up{job="moe-server"} == 1'), 30, procs)

        # 5. A short training run.
        t0 = time.time()
        p = subprocess.run([args.driver, target, str(args.steps), str(args.pause_ms), token_file],
                           capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise TestFailure(f"training_driver failed ({p.returncode}):\n{p.stdout}{p.stderr}")
        print(f"ok: {p.stdout.strip()} in {time.time() - t0:.1f}s")
        time.sleep(2.5)  # two more scrapes, so the counters' last values are in

        # 6. Non-zero rates, through Prometheus's HTTP API.
        rates = {}
        for what, expr in [
                ("forward tokens/s", 'sum(rate(moe_tokens_total{job="moe-server", direction="forward"}[1m]))'),
                ("backward tokens/s", 'sum(rate(moe_tokens_total{job="moe-server", direction="backward"}[1m]))'),
                ("optimizer steps/s", 'sum(rate(moe_optimizer_steps_total{job="moe-server"}[1m]))')]:
            rates[what] = prom.scalar(expr)
            if not rates[what] > 0:
                raise TestFailure(f"{what} = {rates[what]} ({expr}); expected > 0")
        print("ok: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
        # The driver's abandoned context was freed when its connection closed.
        dropped = prom.query('moe_saved_contexts_dropped_total{job="moe-server", reason="session_closed"} >= 1')
        if not dropped:
            raise TestFailure("the context the driver abandoned was not counted as dropped "
                              "(moe_saved_contexts_dropped_total{reason=\"session_closed\"})")
        print("ok: the abandoned context counts in moe_saved_contexts_dropped_total{reason=\"session_closed\"}")

        # 7. Every metric, label and literal label value the rules and dashboard use is exported.
        _, body = http_get(metrics_url)
        scraped = parse_exposition(body)
        queries, dash = used_queries(repo)
        checked = set()
        for where, expr in queries:
            for name, matchers in promql.selectors(expr):
                if name == "up":
                    if not prom.query('up{job="moe-server"}'):
                        raise TestFailure(f"{where}: up{{job=\"moe-server\"}} has no series")
                    continue
                if name not in scraped:
                    raise TestFailure(f"{where} uses {name}, which moe-server does not export "
                                      f"(exported: {sorted(scraped)})")
                checked.add(name)
                for label, op, value in matchers:
                    if label in TARGET_LABELS:
                        continue
                    values = {s.get(label) for s in scraped[name]} - {None}
                    if not values:
                        raise TestFailure(f"{where}: {name} has no label {label!r}")
                    if op == "=" and "$" not in value and value not in values:
                        raise TestFailure(f"{where}: {name}{{{label}={value!r}}} never occurs; "
                                          f"seen {sorted(values)}")
        print(f"ok: {len(checked)} metrics used by {len(queries)} rules, panels and variables "
              f"are exported")

        # 8. Every dashboard query runs and returns data.
        for where, expr in queries:
            if not where.startswith("panel"):
                continue
            res = prom.query(grafana_to_promql(expr))
            if not res:
                raise TestFailure(f"{where}: {grafana_to_promql(expr)} returned no data")
        print("ok: every dashboard query returns data")

        # 9. Every alert rule evaluates without error.
        with open(os.path.join(repo, "deploy/prometheus/alerts.yaml")) as f:
            n_rules = sum(len(g["rules"]) for g in yaml.safe_load(f)["groups"])

        def rules_evaluated():
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            if len(rules) != n_rules:
                raise TestFailure(f"Prometheus loaded {len(rules)} rules, alerts.yaml has {n_rules}")
            bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] == "err"]
            if bad:
                raise TestFailure(f"rules fail to evaluate: {bad}")
            return all(r["health"] == "ok" for r in rules)
        wait_for("every rule evaluated", rules_evaluated, 15, procs)
        firing = [a["labels"]["alertname"] for a in prom.api("alerts")["alerts"]
                  if a["labels"]["alertname"] != "MoeServerMissing"]
        if firing:
            raise TestFailure(f"alerts active on a healthy server: {firing}")
        print(f"ok: {n_rules} alert rules evaluate cleanly, none active")

        # 10. Stop the server: it exits cleanly, and MoeServerDown goes pending.
        server.send_signal(signal.SIGTERM)
        try:
            rc = server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            raise TestFailure("moe-server did not exit within 20 s of SIGTERM")
        if rc != 0:
            raise TestFailure(f"moe-server exited with {rc} on SIGTERM")
        procs[:] = [(n, p) for n, p in procs if p is not server]

        def server_down_alert():
            return [a for a in prom.api("alerts")["alerts"]
                    if a["labels"]["alertname"] == "MoeServerDown" and a["state"] in ("pending", "firing")]
        wait_for("MoeServerDown to go pending", server_down_alert, 20, procs)
        print("ok: after SIGTERM moe-server exits 0 and MoeServerDown goes pending")
        return 0
    except TestFailure as e:
        print(f"FAILED: {e}", file=sys.stderr)
        for name, log in logs.items():
            log.flush()
            log.seek(0)
            tail = log.read()[-3000:]
            print(f"--- {name} log (tail) ---\n{tail}", file=sys.stderr)
        return 1
    finally:
        for name, p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in logs.values():
            log.close()
        subprocess.run(["rm", "-rf", tmp])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", required=True)
    ap.add_argument("--server", required=True)
    ap.add_argument("--driver", required=True)
    ap.add_argument("--probe", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pause_ms", type=int, default=150)
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
