"""The "kubernetes-shards" check of static_checks.py: deploy/kubernetes-shards against the
single-server manifests it mirrors, against itself, and against the Prometheus configs.

  - the StatefulSet's container is the Deployment's (flags, ports, probes, resources, security,
    mounts) but for its NCCL environment, and its pod the Deployment's pod but for the checkpoint
    volume, the sysctl and the spread, so every rule check_kubernetes enforces on the Deployment
    (authentication, quotas, probes, GPU) holds for the shards too; one GPU per pod;
  - the governing Service is headless, named by serviceName, selects the pods and publishes
    the container's gRPC and metrics ports under their names; shard pods and the single
    server's pods never share a Service;
  - every pod gets its own checkpoint claim (volumeClaimTemplates, ReadWriteOnce, retained),
    mounted at --checkpoint_dir; podManagementPolicy Parallel; a spread over nodes whose selector
    matches the pods;
  - the NetworkPolicy selects the pods and opens gRPC and exactly the pod's ephemeral port
    range (NCCL's ports) to the same peers, and metrics; the range avoids the service ports;
  - NCCL_NVLS_ENABLE=0 in the environment;
  - the ServiceMonitor selects the shard Service only, on a port it has, with job="moe-server";
    the Operator kustomization brings the shared rules;
  - deploy/prometheus/prometheus.yml resolves the shard Service's SRV name in the moe-server
    job, and its relabeling, run here on the targets DNS gives, labels each shard's series
    with its pod name and the single server's with none;
  - docs/OPERATIONS.md gives trainers the shards' DNS names in the form the manifests make;
  - kubectl kustomize (where installed) renders both kustomizations.
"""

import os
import re
import shutil

import yaml

SHARDS = "deploy/kubernetes-shards"


def _objects(sc, directory):
    kust = sc.load_yaml_docs(os.path.join(directory, "kustomization.yaml"))[0]
    objs = []
    for res in kust["resources"]:
        if res.endswith(".yaml"):
            objs += sc.load_yaml_docs(os.path.join(directory, res))
    return kust, objs


def _one(sc, objs, kind):
    found = [o for o in objs if o["kind"] == kind]
    if len(found) != 1:
        sc.fail(f"{SHARDS}: expected one {kind}, found {len(found)}")
        return None
    return found[0]


def _selects(selector, labels):
    return bool(selector) and not selector.items() - labels.items()


def _relabel(configs, labels):
    """Prometheus's relabeling ("replace" only, the one action the configs use) on one target."""
    labels = dict(labels)
    for rc in configs:
        if rc.get("action", "replace") != "replace":
            raise ValueError(f"relabel action {rc['action']} is not simulated here")
        value = rc.get("separator", ";").join(labels.get(s, "") for s in rc.get("source_labels", []))
        m = re.fullmatch(rc.get("regex", "(.*)"), value)
        if m:
            replacement = re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", rc.get("replacement", "$1"))
            out = m.expand(replacement)
            if out:
                labels[rc["target_label"]] = out
            else:
                labels.pop(rc["target_label"], None)
    return labels


def _same_pod(sc, dep, sts):
    """The StatefulSet's pod is the Deployment's but for the fields the shards need."""
    dpod, spod = dep["spec"]["template"], sts["spec"]["template"]
    if dpod["metadata"].get("annotations") != spod["metadata"].get("annotations"):
        sc.fail("StatefulSet pod annotations (the scrape annotations) differ from the Deployment's")
    (dc,) = [c for c in dpod["spec"]["containers"] if c["name"] == "moe-server"]
    sc_ = [c for c in spod["spec"]["containers"] if c["name"] == "moe-server"]
    if len(sc_) != 1 or len(spod["spec"]["containers"]) != len(dpod["spec"]["containers"]):
        sc.fail("StatefulSet pod does not have the Deployment's containers")
        return None
    c = sc_[0]
    for key in sorted(set(dc) | set(c)):
        if key != "env" and dc.get(key) != c.get(key):
            sc.fail(f"StatefulSet container {key} differs from the Deployment's:\n"
                    f"    Deployment:  {dc.get(key)}\n    StatefulSet: {c.get(key)}")
    dspec, sspec = dpod["spec"], spod["spec"]
    own = {"containers", "volumes", "topologySpreadConstraints", "affinity", "securityContext"}
    for key in sorted((set(dspec) | set(sspec)) - own):
        if dspec.get(key) != sspec.get(key):
            sc.fail(f"StatefulSet pod {key} differs from the Deployment's")
    sctx = dict(sspec.get("securityContext", {}))
    sctx.pop("sysctls", None)
    if sctx != dspec.get("securityContext"):
        sc.fail("StatefulSet pod securityContext differs from the Deployment's (beyond sysctls)")
    # Volumes: the Deployment's, less the claim the volumeClaimTemplates replace.
    dvols = [v for v in dspec.get("volumes", []) if "persistentVolumeClaim" not in v]
    if dvols != sspec.get("volumes", []):
        sc.fail("StatefulSet pod volumes are not the Deployment's less its checkpoint claim")
    return c


def _port_range(sc, pod_spec):
    ranges = [s["value"] for s in pod_spec.get("securityContext", {}).get("sysctls", [])
              if s["name"] == "net.ipv4.ip_local_port_range"]
    if len(ranges) != 1:
        sc.fail("no net.ipv4.ip_local_port_range sysctl: NCCL's ports cannot be opened by range")
        return None
    lo, hi = (int(x) for x in ranges[0].split())
    if not 1024 <= lo < hi <= 65535:
        sc.fail(f"ip_local_port_range {ranges[0]} is not a range of unprivileged ports")
    return lo, hi


def _network_policy(sc, np, pod_labels, ports, port_range):
    if not _selects(np["spec"]["podSelector"].get("matchLabels"), pod_labels):
        sc.fail("the NetworkPolicy does not select the shard pods")
    if "Ingress" not in np["spec"].get("policyTypes", []):
        sc.fail("the NetworkPolicy has no Ingress policy")
    lo, hi = port_range
    for name, number in ports.items():
        if lo <= number <= hi:
            sc.fail(f"the ephemeral range {lo}-{hi} holds the {name} port {number}")
    grpc_from, nccl_from, metrics = None, None, False
    for rule in np["spec"].get("ingress", []):
        for p in rule.get("ports", []):
            if p.get("protocol", "TCP") != "TCP":
                continue
            if p.get("port") == ports.get("grpc") and "endPort" not in p:
                grpc_from = rule.get("from")
            if p.get("port") == lo and p.get("endPort") == hi:
                nccl_from = rule.get("from")
            if p.get("port") == ports.get("metrics"):
                metrics = True
    if grpc_from is None:
        sc.fail(f"the NetworkPolicy does not open gRPC ({ports.get('grpc')})")
    if nccl_from is None:
        sc.fail(f"the NetworkPolicy does not open NCCL's range {lo}-{hi} (port/endPort)")
    elif nccl_from != grpc_from:
        sc.fail("the NetworkPolicy opens NCCL's range to other peers than gRPC")
    if not metrics:
        sc.fail(f"the NetworkPolicy does not open metrics ({ports.get('metrics')})")


def _monitoring(sc, svc, namespace, sts, replicas):
    kust = sc.load_yaml_docs(os.path.join(SHARDS, "prometheus-operator/kustomization.yaml"))[0]
    if "../../kubernetes/prometheus-operator" not in kust["resources"]:
        sc.fail("the shards' prometheus-operator kustomization does not bring the alert rules")
    (sm,) = [o for r in kust["resources"] if r.endswith(".yaml")
             for o in sc.load_yaml_docs(os.path.join(SHARDS, "prometheus-operator", r))]
    sel = sm["spec"]["selector"]["matchLabels"]
    if not _selects(sel, svc["metadata"]["labels"]):
        sc.fail("the shards' ServiceMonitor does not select the Service moe-shard")
    _, base = _objects(sc, "deploy/kubernetes")
    for s in (o for o in base if o["kind"] == "Service"):
        if _selects(sel, s["metadata"]["labels"]):
            sc.fail(f"the shards' ServiceMonitor also selects {s['metadata']['name']}")
    names = [p["name"] for p in svc["spec"]["ports"]]
    for ep in sm["spec"]["endpoints"]:
        if ep["port"] not in names:
            sc.fail(f"ServiceMonitor endpoint port {ep['port']} is not on the Service")
        job = svc["metadata"]["labels"].get(sm["spec"].get("jobLabel"), svc["metadata"]["name"])
        relabeled = _relabel([{"action": r.get("action", "replace"),
                               "source_labels": r.get("sourceLabels", []),
                               "regex": r.get("regex", "(.*)"),
                               "target_label": r["targetLabel"],
                               "replacement": r.get("replacement", "$1")}
                              for r in ep.get("relabelings", [])], {"job": job})
        if relabeled.get("job") != "moe-server":
            sc.fail(f"the shards' series get job={relabeled.get('job')!r}; the rules expect moe-server")
    # Plain Prometheus: the SRV name, and the pod label its relabeling makes of DNS's targets.
    prom = sc.load_yaml_docs("deploy/prometheus/prometheus.yml")[0]
    (job,) = [j for j in prom["scrape_configs"] if j["job_name"] == "moe-server"]
    svc_name, port_name = svc["metadata"]["name"], "metrics"
    srv = f"_{port_name}._tcp.{svc_name}.{namespace}.svc.cluster.local"
    if srv not in [n for d in job.get("dns_sd_configs", []) for n in d["names"]]:
        sc.fail(f"prometheus.yml's moe-server job does not resolve {srv}")
    zone = f"{namespace}.svc.cluster.local."
    for i in range(replicas):
        pod = f"{sts['metadata']['name']}-{i}"
        got = _relabel(job.get("relabel_configs", []),
                       {"__meta_dns_srv_record_target": f"{pod}.{svc_name}.{zone}"}).get("pod")
        if got != pod:
            sc.fail(f"prometheus.yml labels shard {pod}'s series pod={got!r}")
    other = _relabel(job.get("relabel_configs", []),
                     {"__meta_dns_srv_record_target": f"10-0-0-7.moe-server-metrics.{zone}"})
    if "pod" in other:
        sc.fail(f"prometheus.yml labels the single server pod={other['pod']!r}")


def check(sc):
    """sc: the static_checks module (fail, load_yaml_docs, run, path)."""
    kust, objs = _objects(sc, SHARDS)
    namespace = kust.get("namespace")
    sts, svc, np = (_one(sc, objs, k) for k in ("StatefulSet", "Service", "NetworkPolicy"))
    _, base = _objects(sc, "deploy/kubernetes")
    dep = _one(sc, base, "Deployment")
    if None in (sts, svc, np, dep):
        return
    if namespace != sc.load_yaml_docs("deploy/kubernetes/kustomization.yaml")[0].get("namespace"):
        sc.fail("the shards deploy to another namespace than deploy/kubernetes")
    spec = sts["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    if not _selects(spec["selector"]["matchLabels"], pod_labels):
        sc.fail("StatefulSet selector does not match its pod template labels")
    c = _same_pod(sc, dep, sts)
    if c is None:
        return
    args = dict(a[2:].split("=", 1) for a in c.get("args", []) if a.startswith("--"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for kind in ("requests", "limits"):
        if str(c["resources"].get(kind, {}).get("nvidia.com/gpu")) != "1":
            sc.fail(f"shard container resources.{kind} nvidia.com/gpu is not 1 (one GPU per pod)")
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    if env.get("NCCL_NVLS_ENABLE") != "0":
        sc.fail(f"NCCL_NVLS_ENABLE={env.get('NCCL_NVLS_ENABLE')!r}; the shards keep NVLink SHARP off")
    # The governing Service: headless, the StatefulSet's serviceName, its pods, their ports.
    if svc["metadata"]["name"] != spec.get("serviceName"):
        sc.fail(f"serviceName {spec.get('serviceName')!r} is not the Service "
                f"{svc['metadata']['name']!r}: the pods would get no DNS names")
    if svc["spec"].get("clusterIP") != "None":
        sc.fail("the Service moe-shard is not headless: no per-pod DNS names")
    if not _selects(svc["spec"].get("selector"), pod_labels):
        sc.fail("the Service moe-shard does not select the shard pods")
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    for name in ("grpc", "metrics"):
        p = svc_ports.get(name)
        if p is None:
            sc.fail(f"the Service moe-shard has no port named {name}")
        elif p["port"] != ports.get(name) or p.get("targetPort") not in (name, ports.get(name)):
            sc.fail(f"the Service's {name} port {p['port']} -> {p.get('targetPort')} is not the "
                    f"container's {ports.get(name)}")
    # Shard pods and the single server's pods never meet behind one Service.
    dep_labels = dep["spec"]["template"]["metadata"]["labels"]
    for s in (o for o in base if o["kind"] == "Service"):
        if _selects(s["spec"].get("selector"), pod_labels):
            sc.fail(f"deploy/kubernetes's Service {s['metadata']['name']} selects the shard pods")
    if _selects(svc["spec"].get("selector"), dep_labels):
        sc.fail("the Service moe-shard selects the single server's pods")
    # Checkpoints: a claim per pod, at --checkpoint_dir, kept when scaled down or deleted.
    if spec.get("podManagementPolicy") != "Parallel":
        sc.fail(f"podManagementPolicy is {spec.get('podManagementPolicy')}, not Parallel")
    claims = {t["metadata"]["name"]: t for t in spec.get("volumeClaimTemplates", [])}
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    ckpt = [n for n, mp in mounts.items() if mp == args.get("checkpoint_dir")]
    pod_vols = {v["name"] for v in spec["template"]["spec"].get("volumes", [])}
    if len(ckpt) != 1 or ckpt[0] not in claims or ckpt[0] in pod_vols:
        sc.fail(f"--checkpoint_dir={args.get('checkpoint_dir')} is not on a volumeClaimTemplate "
                f"(mounts {mounts}, templates {sorted(claims)})")
    else:
        t = claims[ckpt[0]]["spec"]
        if t.get("accessModes") != ["ReadWriteOnce"] or "storage" not in t["resources"]["requests"]:
            sc.fail("the checkpoint claim template is not ReadWriteOnce with a storage request")
    retention = spec.get("persistentVolumeClaimRetentionPolicy", {})
    if any(retention.get(k, "Retain") != "Retain" for k in ("whenDeleted", "whenScaled")):
        sc.fail(f"persistentVolumeClaimRetentionPolicy {retention} deletes shards' checkpoints")
    # Spread over nodes: a constraint whose selector matches nothing is silently void.
    pod_spec = spec["template"]["spec"]
    spread = [t for t in pod_spec.get("topologySpreadConstraints", [])
              if t["topologyKey"] == "kubernetes.io/hostname"
              and _selects(t.get("labelSelector", {}).get("matchLabels"), pod_labels)]
    anti = pod_spec.get("affinity", {}).get("podAntiAffinity", {})
    anti_terms = [t.get("podAffinityTerm", t) for k in anti.values() for t in k]
    anti = [t for t in anti_terms if t["topologyKey"] == "kubernetes.io/hostname"
            and _selects(t.get("labelSelector", {}).get("matchLabels"), pod_labels)]
    if not spread and not anti:
        sc.fail("no topology spread or anti-affinity over kubernetes.io/hostname selects the shards")
    port_range = _port_range(sc, pod_spec)
    if port_range:
        _network_policy(sc, np, pod_labels, ports, port_range)
    replicas = next((r["count"] for r in kust.get("replicas", [])
                     if r["name"] == sts["metadata"]["name"]), spec.get("replicas", 1))
    if replicas < 1:
        sc.fail(f"{replicas} shards")
    _monitoring(sc, svc, namespace, sts, replicas)
    # What trainers are told to dial.
    with open(sc.path("docs/OPERATIONS.md")) as f:
        ops = f.read()
    dial = f"{sts['metadata']['name']}-0.{svc['metadata']['name']}.{namespace}.svc:{ports.get('grpc')}"
    if dial not in ops:
        sc.fail(f"docs/OPERATIONS.md does not give trainers the shard address {dial}")
    if shutil.which("kubectl"):
        for d, count in ((SHARDS, len(objs)), (SHARDS + "/prometheus-operator", None)):
            rc, out = sc.run(["kubectl", "kustomize", sc.path(d)])
            if rc != 0:
                sc.fail(f"kubectl kustomize {d}:\n{out}")
                continue
            rendered = [x for x in yaml.safe_load_all(out) if x]
            if count is not None and len(rendered) != count:
                sc.fail(f"kubectl kustomize {d} renders {len(rendered)} objects, {count} listed")
            if count is None and {"PrometheusRule", "ServiceMonitor"} - {o["kind"] for o in rendered}:
                sc.fail(f"kubectl kustomize {d} renders no PrometheusRule or ServiceMonitor")
        print("kubectl kustomize renders both shard kustomizations")
    print(f"kubernetes-shards: {replicas} shards {sts['metadata']['name']}-0.."
          f"{replicas - 1} behind {svc['metadata']['name']} in {namespace}; NCCL ports "
          f"{port_range}; trainers dial {dial}")
