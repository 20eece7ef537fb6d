"""Finds the metric selectors in PromQL expressions, for the deploy tests.

The tests check that every metric the alert rules and the Grafana dashboard use is one
moe-server really exports (against a live scrape), so they need each expression's metric
names and label matchers. Prometheus has no offline parser the tests could call (promtool
checks whole rule files only), so this is a small tokenizer: identifiers followed by "(" are
functions, identifiers in {...} are label names, the parenthesised list after by/without/on/
ignoring/group_left/group_right holds label names, [...] holds durations; every other
identifier is a metric name.
"""

import re

_TOKEN = re.compile(
    r'\s+|(?P<str>"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`)'
    r'|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)'
    r'|(?P<num>[0-9][0-9A-Za-z_.+]*)'
    r'|(?P<var>\$[A-Za-z0-9_{}]+)'
    r'|(?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=(){}\[\],@])')

_LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = _LABEL_LIST_KEYWORDS | {"bool", "and", "or", "unless", "offset", "inf", "nan",
                                    "Inf", "NaN"}
# Aggregations may put their by/without clause before the parenthesis: sum by (x) (...).
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                 "bottomk", "topk", "quantile"}


def _tokens(expr):
    pos = 0
    out = []
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise ValueError(f"cannot tokenize PromQL at {expr[pos:pos + 20]!r} in {expr!r}")
        pos = m.end()
        kind = m.lastgroup
        if kind is None:
            continue  # whitespace
        text = m.group(kind)
        if kind == "str":
            text = bytes(text[1:-1], "utf-8").decode("unicode_escape")
        out.append((kind, text))
    return out


def selectors(expr):
    """Returns [(metric_name, [(label, op, value), ...]), ...] for every selector in expr."""
    toks = _tokens(expr)
    found = []
    i = 0
    n = len(toks)
    while i < n:
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < n else None
        if kind == "op" and text == "[":
            while i < n and toks[i][1] != "]":
                i += 1
            i += 1
            continue
        if kind == "ident" and text in _LABEL_LIST_KEYWORDS and nxt == "(":
            while i < n and toks[i][1] != ")":
                i += 1
            i += 1
            continue
        if kind == "ident" and nxt == "(" or kind == "ident" and text in _KEYWORDS | _AGGREGATIONS:
            i += 1
            continue
        if kind == "ident" or (kind == "op" and text == "{"):
            name = text if kind == "ident" else None
            if kind == "ident":
                i += 1
            matchers = []
            if i < n and toks[i][1] == "{":
                i += 1
                while i < n and toks[i][1] != "}":
                    if toks[i][1] == ",":
                        i += 1
                        continue
                    label, op, value = toks[i][1], toks[i + 1][1], toks[i + 2][1]
                    matchers.append((label, op, value))
                    i += 3
                i += 1
            for label, op, value in matchers:
                if label == "__name__" and op == "=":
                    name = value
            if name is None:
                raise ValueError(f"selector without a metric name in {expr!r}")
            found.append((name, matchers))
            continue
        i += 1
    return found


def metric_names(expr):
    return {name for name, _ in selectors(expr)}


def _self_test():
    e = ('histogram_quantile(0.99, sum by (le, stage) (rate(moe_stage_duration_seconds_bucket'
         '{instance=~"$instance", method="Forward"}[$__rate_interval]))) > 1')
    assert selectors(e) == [("moe_stage_duration_seconds_bucket",
                             [("instance", "=~", "$instance"), ("method", "=", "Forward")])], selectors(e)
    e = ('max by (layer) (sum by (layer, expert) (rate(moe_expert_tokens_total[5m]))) / '
         'on (layer) group_left avg by (layer) (moe_layers) unless absent(up{job="moe-server"})')
    assert metric_names(e) == {"moe_expert_tokens_total", "moe_layers", "up"}, metric_names(e)
    assert metric_names("moe_a / (moe_b > 0) > 0.9") == {"moe_a", "moe_b"}


if __name__ == "__main__":
    _self_test()
    print("promql self-test passed")
