"""Checks of the shipped deployment files that need no running server.

ctest runs each check as its own test (tests/deploy/CMakeLists.txt):
  yamllint        every YAML file in the repository passes yamllint --strict
  promtool        promtool check config/rules on both Prometheus configs (the compose one laid
                  out as compose mounts it) and promtool test rules on alerts_test.yaml
  kubernetes      the manifests agree with each other, with the image and with the proto:
                  ports, probe service names, GPU requests, volume, scrape annotations, SRV name;
                  authentication on (tokens file from a read-only Secret mount, an admin
                  principal), per-principal quotas, and the listening addresses set for a pod
  kubernetes-shards  deploy/kubernetes-shards: the StatefulSet's pod is the Deployment's but for
                  what shards need; Service, claims, NetworkPolicy with NCCL's port range,
                  ServiceMonitor, Prometheus's pod label (kubernetes_shards.py says what)
  compose         compose.yaml's mounts exist and its Prometheus/Grafana wiring lines up;
                  authentication on with a git-ignored tokens file as a compose secret, quotas
  dockerfile      multi-stage CUDA devel -> runtime, non-root, no RUN in the final stage, and
                  every RUN is a script that CI also runs; the default command has
                  authentication and quotas on
  dashboard       the Grafana JSON is well formed and its PromQL parses into metric selectors
Each prints what it checked and exits 1 with the reasons when something is wrong.

Usage: static_checks.py REPO_ROOT CHECK
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

import yaml

import kubernetes_shards
import promql

ROOT = None
errors = []


def fail(msg):
    errors.append(msg)


def path(*parts):
    return os.path.join(ROOT, *parts)


def load_yaml_docs(rel):
    with open(path(rel)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    return p.returncode, p.stdout + p.stderr


def yaml_files():
    """Every YAML file in the repository: git's list when this is a checkout, else a walk."""
    rc, out = run(["git", "-C", ROOT, "ls-files", "--cached", "--others", "--exclude-standard",
                   "*.yaml", "*.yml"])
    if rc == 0:
        files = [f for f in out.split("\n") if f and os.path.exists(path(f))]
    else:
        files = []
        for d, dirs, names in os.walk(ROOT):
            dirs[:] = [x for x in dirs if not x.startswith((".git", "build"))]
            files += [os.path.relpath(os.path.join(d, x), ROOT) for x in names
                      if x.endswith((".yaml", ".yml"))]
    return sorted(files)


def check_auth_args(where, args):
    """The flags every shipped moe-server command line needs for a network-facing server with
    authentication on. Returns the tokens file's path."""
    for flag in ("host", "metrics_host"):
        if args.get(flag) != "0.0.0.0":
            fail(f"{where}: --{flag}={args.get(flag)}; a container's loopback is unreachable from "
                 "outside it, so the shipped command lines set 0.0.0.0 explicitly")
    tokens = args.get("tokens_file", "")
    if not tokens.startswith("/"):
        fail(f"{where}: no --tokens_file (absolute path): authentication is off")
    admins = [a for a in args.get("admin_principals", "").split(",") if a]
    if not admins:
        fail(f"{where}: no --admin_principals")
    # Admission control and per-principal quotas, so one principal cannot lock the others out:
    # the quotas and the short TTL must be on (> 0); the budget may be derived (0).
    for flag, least in (("principal_layer_bytes_quota", 1), ("principal_context_bytes_quota", 1),
                        ("sessionless_context_ttl_seconds", 1), ("memory_budget_bytes", 0)):
        try:
            value = float(args[flag])
        except (KeyError, ValueError):
            fail(f"{where}: no numeric --{flag}")
            continue
        if value < least:
            fail(f"{where}: --{flag}={args[flag]} turns it off")
    return tokens


def check_yamllint():
    files = yaml_files()
    for must in ("docker/compose.yaml", "deploy/prometheus/alerts.yaml",
                 "deploy/kubernetes/deployment.yaml", "deploy/kubernetes-shards/statefulset.yaml"):
        if must not in files:
            fail(f"{must} was not found among the YAML files; the file list is wrong")
    rc, out = run(["yamllint", "--strict", "-c", path("tests/deploy/yamllint.yaml")] + files,
                  cwd=ROOT)
    if rc != 0:
        fail("yamllint:\n" + out)
    print(f"yamllint --strict: {len(files)} files")


def check_promtool_rules():
    rc, out = run(["promtool", "check", "rules", path("deploy/prometheus/alerts.yaml")])
    if rc != 0:
        fail("promtool check rules deploy/prometheus/alerts.yaml:\n" + out)
    # The Operator's PrometheusRule carries the same groups under spec.
    rule = load_yaml_docs("deploy/kubernetes/prometheus-operator/prometheusrule.yaml")[0]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump({"groups": rule["spec"]["groups"]}, f)
        f.flush()
        rc, out2 = run(["promtool", "check", "rules", f.name])
        if rc != 0:
            fail("promtool check rules on the PrometheusRule's spec:\n" + out2)
    print(out.strip())


def check_promtool_test():
    rc, out = run(["promtool", "test", "rules", path("deploy/prometheus/alerts_test.yaml")])
    if rc != 0 or "SUCCESS" not in out:
        fail("promtool test rules deploy/prometheus/alerts_test.yaml:\n" + out)
    print(out.strip())


def check_promtool_config():
    rc, out = run(["promtool", "check", "config", path("deploy/prometheus/prometheus.yml")])
    if rc != 0 or "SUCCESS: 1 rule files found" not in out:
        fail("promtool check config deploy/prometheus/prometheus.yml:\n" + out)
    # The compose Prometheus sees its files where compose mounts them: lay them out the same
    # way so a mount that points at the wrong file fails here.
    compose = load_yaml_docs("docker/compose.yaml")[0]
    with tempfile.TemporaryDirectory() as tmp:
        config_in_container = None
        for arg in compose["services"]["prometheus"].get("command", []):
            if arg.startswith("--config.file="):
                config_in_container = arg.split("=", 1)[1]
        if not config_in_container:
            fail("compose prometheus service has no --config.file")
            return
        for vol in compose["services"]["prometheus"].get("volumes", []):
            src, dst = vol.split(":")[:2]
            if not src.startswith((".", "/")):
                continue  # a named volume
            src = os.path.normpath(os.path.join(ROOT, "docker", src))
            dst = os.path.join(tmp, dst.lstrip("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(src, dst)
        cfg = os.path.join(tmp, config_in_container.lstrip("/"))
        rc, out = run(["promtool", "check", "config", cfg])
        if rc != 0 or "SUCCESS: 1 rule files found" not in out or "7 rules found" not in out:
            fail("promtool check config on the compose Prometheus layout:\n" + out)
    print("promtool check config: deploy/prometheus/prometheus.yml and the compose layout")


def check_kubernetes():
    kust = load_yaml_docs("deploy/kubernetes/kustomization.yaml")[0]
    namespace = kust.get("namespace")
    objs = []
    for res in kust["resources"]:
        objs += load_yaml_docs(os.path.join("deploy/kubernetes", res))
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    deps = by_kind.get("Deployment", [])
    if len(deps) != 1:
        fail(f"expected one Deployment, found {len(deps)}")
        return
    dep = deps[0]
    pod = dep["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    if dep["spec"]["selector"]["matchLabels"].items() - pod_labels.items():
        fail("Deployment selector does not match its pod template labels")
    spec = pod["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "moe-server"]
    args = dict(a[2:].split("=", 1) for a in c.get("args", []) if a.startswith("--"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    if str(ports.get("grpc")) != args.get("port"):
        fail(f"container port grpc {ports.get('grpc')} != --port {args.get('port')}")
    if str(ports.get("metrics")) != args.get("metrics_port"):
        fail(f"container port metrics {ports.get('metrics')} != --metrics_port {args.get('metrics_port')}")
    res = c.get("resources", {})
    for kind in ("requests", "limits"):
        if int(res.get(kind, {}).get("nvidia.com/gpu", 0)) < 1:
            fail(f"container resources.{kind} does not ask for nvidia.com/gpu")
    for r in ("cpu", "memory"):
        if r not in res.get("requests", {}):
            fail(f"container resources.requests has no {r}")
    if not args.get("device", "").startswith("cuda"):
        fail(f"--device={args.get('device')} on a GPU pod")
    # Authentication: the tokens file comes from a Secret, mounted read-only, not group- or
    # world-writable and not readable by others.
    tokens = check_auth_args("deployment.yaml", args)
    token_mounts = [m for m in c.get("volumeMounts", [])
                    if tokens.startswith(m["mountPath"].rstrip("/") + "/")]
    if len(token_mounts) != 1:
        fail(f"--tokens_file={tokens} is not in exactly one volume mount")
    else:
        m = token_mounts[0]
        vol = {v["name"]: v for v in spec.get("volumes", [])}.get(m["name"], {})
        secret = vol.get("secret")
        if not secret or not secret.get("secretName"):
            fail(f"--tokens_file={tokens} is not in a Secret volume")
        else:
            rel = tokens[len(m["mountPath"].rstrip("/")) + 1:]
            items = {i["path"]: i["key"] for i in secret.get("items", [])}
            if items and rel not in items:
                fail(f"the Secret volume {m['name']} holds {sorted(items)}, not {rel}")
            if int(secret.get("defaultMode", 0o644)) & 0o027:
                fail(f"the tokens Secret's defaultMode {oct(secret.get('defaultMode', 0o644))} lets "
                     "others read it or the group write it")
        if not m.get("readOnly"):
            fail(f"the tokens mount {m['mountPath']} is not readOnly")
    # Probes: native gRPC probes on the service port; readiness on the service trainers call.
    with open(path("proto/moe/v1/moe.proto")) as f:
        proto = f.read()
    package = re.search(r"^package\s+([\w.]+);", proto, re.M).group(1)
    services = [f"{package}.{s}" for s in re.findall(r"^service\s+(\w+)", proto, re.M)]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        p = c.get(probe)
        if not p or "grpc" not in p:
            fail(f"{probe} is not a gRPC probe")
            continue
        if p["grpc"]["port"] != ports.get("grpc"):
            fail(f"{probe} port {p['grpc']['port']} is not the gRPC port {ports.get('grpc')}")
    ready_service = c.get("readinessProbe", {}).get("grpc", {}).get("service")
    if ready_service not in services:
        fail(f"readinessProbe service {ready_service!r} is not a service of the proto {services}")
    # Checkpoints on the PVC.
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    pvcs = {o["metadata"]["name"] for o in by_kind.get("PersistentVolumeClaim", [])}
    ckpt_mount = [n for n, mp in mounts.items() if mp == args.get("checkpoint_dir")]
    if not ckpt_mount:
        fail(f"--checkpoint_dir={args.get('checkpoint_dir')} is not a mounted volume")
    else:
        claim = vols[ckpt_mount[0]].get("persistentVolumeClaim", {}).get("claimName")
        if claim not in pvcs:
            fail(f"checkpoint volume claims {claim!r}, not one of the PVCs {sorted(pvcs)}")
    # Non-root, and the same uid as the image.
    sc = spec.get("securityContext", {})
    with open(path("docker/Dockerfile")) as f:
        image_user = re.findall(r"^USER\s+(\S+)", f.read(), re.M)[-1].split(":")[0]
    if not sc.get("runAsNonRoot") or str(sc.get("runAsUser")) != image_user:
        fail(f"pod securityContext runAsUser {sc.get('runAsUser')} / runAsNonRoot "
             f"{sc.get('runAsNonRoot')} does not match the image's USER {image_user}")
    # Scrape annotations.
    ann = pod["metadata"].get("annotations", {})
    if ann.get("prometheus.io/scrape") != "true" or ann.get("prometheus.io/port") != args.get("metrics_port"):
        fail(f"pod scrape annotations {ann} do not point at --metrics_port")
    # Services select the pod and name its ports.
    svcs = {o["metadata"]["name"]: o for o in by_kind.get("Service", [])}
    for name, s in svcs.items():
        if s["spec"]["selector"].items() - pod_labels.items():
            fail(f"Service {name} selector does not match the pod labels")
        for p in s["spec"]["ports"]:
            if p["targetPort"] not in ports:
                fail(f"Service {name} targets port {p['targetPort']!r}, not a container port")
    if not any(p["targetPort"] == "grpc" for s in svcs.values() for p in s["spec"]["ports"]):
        fail("no Service exposes the gRPC port")
    # The plain-Prometheus config discovers pods through the headless Service's SRV records.
    prom = load_yaml_docs("deploy/prometheus/prometheus.yml")[0]
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "moe-server"]
    srv = job["dns_sd_configs"][0]["names"][0]
    m = re.match(r"_([\w-]+)\._tcp\.([\w-]+)\.([\w-]+)\.svc\.", srv)
    if not m:
        fail(f"unexpected SRV name {srv}")
    else:
        port_name, svc_name, ns = m.groups()
        s = svcs.get(svc_name)
        if s is None:
            fail(f"prometheus.yml resolves Service {svc_name}, which is not in the manifests")
        else:
            if s["spec"].get("clusterIP") != "None":
                fail(f"Service {svc_name} is not headless: SRV would give one VIP, not every pod")
            if port_name not in [p["name"] for p in s["spec"]["ports"]]:
                fail(f"Service {svc_name} has no port named {port_name}")
        if ns != namespace:
            fail(f"prometheus.yml looks in namespace {ns}, the kustomization deploys to {namespace}")
    # The Operator's ServiceMonitor selects the metrics Service and names its port.
    sm = load_yaml_docs("deploy/kubernetes/prometheus-operator/servicemonitor.yaml")[0]
    sel = sm["spec"]["selector"]["matchLabels"]
    matched = [n for n, s in svcs.items() if not sel.items() - s["metadata"]["labels"].items()]
    if len(matched) != 1:
        fail(f"ServiceMonitor selects {matched}, expected exactly the metrics Service")
    else:
        names = [p["name"] for p in svcs[matched[0]]["spec"]["ports"]]
        for ep in sm["spec"]["endpoints"]:
            if ep["port"] not in names:
                fail(f"ServiceMonitor endpoint port {ep['port']} not on Service {matched[0]}")
    job_label = sm["spec"].get("jobLabel")
    if svcs.get(matched[0] if matched else "", {}).get("metadata", {}).get("labels", {}).get(job_label) != "moe-server":
        fail("ServiceMonitor jobLabel does not give job=moe-server, which the rules expect")
    rule = load_yaml_docs("deploy/kubernetes/prometheus-operator/prometheusrule.yaml")[0]
    alerts = load_yaml_docs("deploy/prometheus/alerts.yaml")[0]
    if rule["spec"]["groups"] != alerts["groups"]:
        fail("PrometheusRule groups differ from deploy/prometheus/alerts.yaml; "
             "run scripts/sync-prometheusrule")
    # Where kubectl is installed (not a project dependency), its built-in kustomize must
    # render both kustomizations: it catches what reading the files one by one cannot.
    if shutil.which("kubectl"):
        for d in ("deploy/kubernetes", "deploy/kubernetes/prometheus-operator"):
            rc, out = run(["kubectl", "kustomize", path(d)])
            if rc != 0:
                fail(f"kubectl kustomize {d}:\n{out}")
            elif d == "deploy/kubernetes" and len([x for x in yaml.safe_load_all(out) if x]) != len(objs):
                fail(f"kubectl kustomize {d} renders a different number of objects than listed")
        print("kubectl kustomize renders both kustomizations")
    print(f"kubernetes: {len(objs)} objects in namespace {namespace}; probes ask for "
          f"{ready_service!r}; Prometheus resolves {srv}")


def check_compose():
    compose = load_yaml_docs("docker/compose.yaml")[0]
    svc = compose["services"]
    for need in ("moe-server", "prometheus", "grafana"):
        if need not in svc:
            fail(f"compose has no {need} service")
    if errors:
        return
    build = svc["moe-server"]["build"]
    ctx = os.path.normpath(os.path.join(ROOT, "docker", build["context"]))
    if ctx != os.path.normpath(ROOT) or not os.path.exists(os.path.join(ctx, build["dockerfile"])):
        fail(f"moe-server build context {ctx} / dockerfile {build['dockerfile']} is wrong")
    args = dict(a[2:].split("=", 1) for a in svc["moe-server"]["command"])
    # Authentication: the tokens file is a compose secret whose file git never tracks.
    tokens = check_auth_args("compose moe-server", args)
    secret_names = [x if isinstance(x, str) else x.get("source")
                    for x in svc["moe-server"].get("secrets", [])]
    m = re.match(r"/run/secrets/([\w.-]+)$", tokens)
    if not m or m.group(1) not in secret_names:
        fail(f"--tokens_file={tokens} is not one of the service's secrets {secret_names}")
    else:
        src = compose.get("secrets", {}).get(m.group(1), {}).get("file")
        if not src:
            fail(f"compose secret {m.group(1)} has no file")
        else:
            rel = os.path.relpath(os.path.normpath(os.path.join(ROOT, "docker", src)), ROOT)
            rc, _ = run(["git", "-C", ROOT, "check-ignore", "-q", "--no-index", rel])
            if rc != 0:
                fail(f"the tokens file {rel} is not git-ignored: real tokens would be committed")
    for p in svc["moe-server"].get("ports", []):
        if p.split(":")[-1] == args.get("metrics_port") and not p.startswith("127.0.0.1:"):
            fail(f"compose publishes metrics as {p}, beyond the host's loopback")
    reservations = svc["moe-server"].get("deploy", {}).get("resources", {}).get("reservations", {})
    if not any("gpu" in d.get("capabilities", []) for d in reservations.get("devices", [])):
        fail("compose moe-server reserves no GPU")
    published = {p.split(":")[-2] for p in svc["moe-server"].get("ports", [])}
    for flag in ("port", "metrics_port"):
        if args.get(flag) not in published:
            fail(f"compose publishes {sorted(published)}, not --{flag}={args.get(flag)}")
    hc = svc["moe-server"].get("healthcheck", {}).get("test", [])
    with open(path("scripts/stage-runtime")) as f:
        required = re.search(r"^required=\((.*)\)", f.read(), re.M).group(1).split()
    if len(hc) < 2 or hc[0] != "CMD" or hc[1] not in required:
        fail(f"moe-server healthcheck {hc} does not run a program the image always has {required}")
    named = set(compose.get("volumes", {}))
    mounts = {}
    for name, s in svc.items():
        for vol in s.get("volumes", []):
            src, dst = vol.split(":")[:2]
            if src.startswith((".", "/")):
                if not os.path.exists(os.path.normpath(os.path.join(ROOT, "docker", src))):
                    fail(f"compose {name} mounts {src}, which does not exist")
            elif src not in named:
                fail(f"compose {name} uses volume {src}, which is not declared")
            mounts.setdefault(name, {})[dst] = src
    if args.get("checkpoint_dir") not in mounts.get("moe-server", {}):
        fail("--checkpoint_dir is not on a volume in compose")
    # Prometheus scrapes the server by service name on its metrics port.
    prom = load_yaml_docs("docker/prometheus/prometheus.yml")[0]
    targets = [t for j in prom["scrape_configs"] if j["job_name"] == "moe-server"
               for sc in j["static_configs"] for t in sc["targets"]]
    if targets != [f"moe-server:{args.get('metrics_port')}"]:
        fail(f"compose Prometheus scrapes {targets}, not moe-server:{args.get('metrics_port')}")
    # Grafana: the provisioned datasource reaches the prometheus service, and the dashboard
    # provider's folder is where compose mounts the dashboard JSON.
    prov_dir = mounts["grafana"].get("/etc/grafana/provisioning")
    if not prov_dir:
        fail("grafana has no provisioning mount")
        return
    prov = os.path.normpath(os.path.join(ROOT, "docker", prov_dir))
    ds = yaml.safe_load(open(os.path.join(prov, "datasources", "prometheus.yaml")))
    url = ds["datasources"][0]["url"]
    if not re.match(r"http://prometheus:9090/?$", url):
        fail(f"Grafana datasource url {url} is not the compose prometheus service")
    prov_dash = yaml.safe_load(open(os.path.join(prov, "dashboards", "moe-offload.yaml")))
    dash_dir = prov_dash["providers"][0]["options"]["path"]
    dash_mounts = [d for d in mounts["grafana"] if os.path.dirname(d) == dash_dir and d.endswith(".json")]
    if not dash_mounts:
        fail(f"no dashboard JSON is mounted into the provider folder {dash_dir}")
    home = svc["grafana"].get("environment", {}).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home and home not in mounts["grafana"]:
        fail(f"Grafana home dashboard {home} is not mounted")
    print(f"compose: {sorted(svc)}; Prometheus scrapes {targets}; Grafana loads {dash_mounts}")


def dockerfile_stages():
    with open(path("docker/Dockerfile")) as f:
        text = f.read()
    text = re.sub(r"\\\n", " ", text)  # join continuation lines
    stages = []
    for line in text.split("\n"):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stages.append({"from": rest.split()[0], "name": rest.split()[-1] if " AS " in rest.upper() else None,
                           "lines": []})
        elif stages:
            stages[-1]["lines"].append((word, rest.strip()))
    return stages


def check_dockerfile():
    stages = dockerfile_stages()
    if len(stages) < 2:
        fail("Dockerfile is not multi-stage")
        return
    build, final = stages[0], stages[-1]
    if not re.match(r"nvidia/cuda:\$\{CUDA_VERSION\}-devel-", build["from"]):
        fail(f"build stage is {build['from']}, not a CUDA devel image")
    if not re.match(r"nvidia/cuda:\$\{CUDA_VERSION\}-runtime-", final["from"]):
        fail(f"final stage is {final['from']}, not a CUDA runtime image")
    users = [rest for w, rest in final["lines"] if w == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        fail("final stage does not switch to a non-root USER")
    if any(w == "RUN" for w, _ in final["lines"]):
        fail("final stage has a RUN step, which no CI script exercises")
    for w, rest in final["lines"]:
        if w in ("COPY", "ADD") and "--from=" in rest:
            src = rest.split()[-2]
            if not src.startswith("/stage/"):
                fail(f"final stage copies {src}, which stage-runtime did not lay out")
        elif w in ("COPY", "ADD"):
            fail(f"final stage copies from the build context: {rest}")
    # Every RUN is a chain of `bash scripts/<name>` that CI runs too.
    # What CI runs: scripts/test, and the deploy test that replays the build stage (it must
    # be registered with ctest for its commands to count).
    with open(path("scripts/test")) as f:
        ci_text = f.read()
    with open(path("tests/deploy/CMakeLists.txt")) as f:
        cmake_text = f.read()
    if re.search(r"add_test\(NAME DeployStageRuntime\s+COMMAND bash \S+/stage_runtime_test.sh", cmake_text):
        with open(path("tests/deploy/stage_runtime_test.sh")) as f:
            ci_text += "\n".join(l for l in f.read().split("\n") if not l.lstrip().startswith("#"))
    else:
        fail("DeployStageRuntime is not registered with ctest")
    used = set()
    for stage in stages[:-1]:
        for w, rest in stage["lines"]:
            if w != "RUN":
                continue
            for cmd in re.split(r"&&", rest):
                words = shlex.split(cmd)
                while words and re.match(r"^[A-Z_]+=", words[0]):
                    words = words[1:]
                if len(words) < 2 or words[0] != "bash" or not words[1].startswith("scripts/"):
                    fail(f"RUN step {cmd.strip()!r} is not a project script")
                    continue
                script = words[1]
                used.add(script)
                if not os.path.exists(path(script)):
                    fail(f"RUN step runs {script}, which does not exist")
                if script not in ci_text:
                    fail(f"RUN step runs {script}, which neither scripts/test nor a deploy test runs")
    with open(path("docker/Dockerfile")) as f:
        text = f.read()
    entry = re.search(r'^ENTRYPOINT\s+\["([^"]+)"', text, re.M)
    with open(path("scripts/stage-runtime")) as f:
        staged = f.read()
    if not entry or not re.search(r"^required=\(.*\b%s\b" % re.escape(entry.group(1)), staged, re.M):
        fail("ENTRYPOINT is not a program scripts/stage-runtime requires")
    cmd = json.loads(re.search(r"^CMD\s+(\[.*\])", text, re.M).group(1))
    args = dict(a[2:].split("=", 1) for a in cmd)
    exposed = set(re.search(r"^EXPOSE\s+(.*)$", text, re.M).group(1).split())
    if {args.get("port"), args.get("metrics_port")} != exposed:
        fail(f"EXPOSE {sorted(exposed)} differs from CMD ports {args}")
    check_auth_args("Dockerfile CMD", args)
    print(f"Dockerfile: {len(stages)} stages, RUN steps {sorted(used)}, user {users[-1] if users else None}")


def dashboard_exprs(dash):
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def check_dashboard():
    with open(path("deploy/grafana/moe-offload.json")) as f:
        dash = json.load(f)
    ids = [p["id"] for p in dash["panels"]]
    if len(ids) != len(set(ids)):
        fail("dashboard panel ids are not unique")
    var_names = {v["name"] for v in dash["templating"]["list"]}
    titles = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        if g["x"] + g["w"] > 24:
            fail(f"panel {p['title']} is wider than the grid")
        if p["type"] == "row":
            continue
        titles.add(p["title"])
        if p.get("datasource", {}).get("uid") != "${datasource}":
            fail(f"panel {p['title']} does not use the ${{datasource}} variable")
        if not p.get("targets"):
            fail(f"panel {p['title']} has no query")
        for t in p.get("targets", []):
            for v in re.findall(r"\$(\w+)", t["expr"]):
                if v not in var_names and not v.startswith("__"):
                    fail(f"panel {p['title']} uses undefined variable ${v}")
    names = set()
    for title, expr in dashboard_exprs(dash):
        try:
            names |= promql.metric_names(expr)
        except ValueError as e:
            fail(f"panel {title}: {e}")
    # What the issue asks the dashboard to show.
    for must in ("moe_tokens_total", "moe_stage_duration_seconds_bucket",
                 "moe_expert_tokens_total", "moe_device_memory_used_bytes"):
        if must not in names:
            fail(f"dashboard does not show {must}")
    print(f"dashboard: {len(titles)} panels over {len(names)} metrics")


CHECKS = {
    "yamllint": check_yamllint,
    "promtool-config": check_promtool_config,
    "promtool-rules": check_promtool_rules,
    "promtool-test": check_promtool_test,
    "kubernetes": check_kubernetes,
    "kubernetes-shards": lambda: kubernetes_shards.check(sys.modules[__name__]),
    "compose": check_compose,
    "dockerfile": check_dockerfile,
    "dashboard": check_dashboard,
}


def main():
    global ROOT
    if len(sys.argv) != 3 or sys.argv[2] not in CHECKS:
        print(__doc__, file=sys.stderr)
        return 2
    ROOT = os.path.abspath(sys.argv[1])
    try:
        CHECKS[sys.argv[2]]()
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
        fail(f"{type(e).__name__}: {e} (a file lacks a field the check expects)")
    if errors:
        print(f"FAILED {sys.argv[2]}:", *errors, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
