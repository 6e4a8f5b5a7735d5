{{/*
The PromQL the chart's ScaledObjects use, on the proxy's metrics (proxy/metrics.py). Several proxy replicas export
the same per-node series: `max by (node_id)` counts each node once.
*/}}
{{- define "tandem.promSelector" -}}
namespace="{{ .root.Release.Namespace }}",model_name="{{ include "tandem.servedModelName" .root }}"
{{- end -}}

{{- define "tandem.scalingQuery" -}}
{{- $sel := include "tandem.promSelector" . -}}
{{- if eq .metric "queued_prompt_tokens" -}}
sum(max by (node_id) (tandem:num_queued_prefill_tokens{ {{- $sel }},role="{{ .role }}"}))
{{- else if eq .metric "running_requests" -}}
sum(max by (node_id) (tandem:node_num_requests_running{ {{- $sel }},role="{{ .role }}"}))
{{- else if eq .metric "kv_cache_usage" -}}
avg(max by (node_id) (tandem:kv_cache_usage_perc{ {{- $sel }},role="{{ .role }}"}))
{{- else if eq .metric "ttft_p90_seconds" -}}
histogram_quantile(0.9, sum by (le) (rate(tandem:time_to_first_token_seconds_bucket{ {{- $sel }}}[2m])))
{{- else if eq .metric "itl_p90_seconds" -}}
histogram_quantile(0.9, sum by (le) (rate(tandem:inter_token_latency_seconds_bucket{ {{- $sel }}}[2m])))
{{- else if eq .metric "requests_in_flight" -}}
sum(tandem:num_requests_running{ {{- $sel }}})
{{- else -}}
{{- fail (printf "autoscaling.metric %q is not one Tandem scales on" .metric) -}}
{{- end -}}
{{- end -}}

{{/* Totals scale per replica (AverageValue); fractions and latencies compare as they are (Value). */}}
{{- define "tandem.scalingMetricType" -}}
{{- if has . (list "queued_prompt_tokens" "running_requests" "requests_in_flight") -}}AverageValue{{- else -}}Value{{- end -}}
{{- end -}}
