// A plain OpenTelemetry JavaScript app: 50 steps of a gauge, a counter and a histogram with a
// `train.step` attribute, and a span per step, exported with the SDK's own OTLP exporters.
// Usage: node sender.mjs <grpc|http/json|http/protobuf> <cumulative|delta> <endpoint> <run id>
import { resourceFromAttributes } from '@opentelemetry/resources';
import { MeterProvider, PeriodicExportingMetricReader } from '@opentelemetry/sdk-metrics';
import { BasicTracerProvider, SimpleSpanProcessor } from '@opentelemetry/sdk-trace-base';

const [protocol, temporality, endpoint, runId] = process.argv.slice(2);
const modules = {
  grpc: ['@opentelemetry/exporter-metrics-otlp-grpc', '@opentelemetry/exporter-trace-otlp-grpc'],
  'http/json': ['@opentelemetry/exporter-metrics-otlp-http', '@opentelemetry/exporter-trace-otlp-http'],
  'http/protobuf': ['@opentelemetry/exporter-metrics-otlp-proto', '@opentelemetry/exporter-trace-otlp-proto'],
}[protocol];
const { OTLPMetricExporter } = await import(modules[0]);
const { OTLPTraceExporter } = await import(modules[1]);
const { AggregationTemporalityPreference } = await import('@opentelemetry/exporter-metrics-otlp-http');
const grpc = protocol === 'grpc';

const resource = resourceFromAttributes({ 'service.name': 'js-app', 'train.run.id': runId });
const metricExporter = new OTLPMetricExporter({
  url: grpc ? endpoint : `${endpoint}/v1/metrics`,
  ...(temporality === 'delta' ? { temporalityPreference: AggregationTemporalityPreference.DELTA } : {}),
});
const reader = new PeriodicExportingMetricReader({ exporter: metricExporter, exportIntervalMillis: 3600000 });
const meterProvider = new MeterProvider({ resource, readers: [reader] });
const tracerProvider = new BasicTracerProvider({
  resource,
  spanProcessors: [new SimpleSpanProcessor(new OTLPTraceExporter({ url: grpc ? endpoint : `${endpoint}/v1/traces` }))],
});
const meter = meterProvider.getMeter('js-app');
const tracer = tracerProvider.getTracer('js-app');
const loss = meter.createGauge('train/loss');
const tokens = meter.createCounter('train/tokens');
const grad = meter.createHistogram('train/grad', { advice: { explicitBucketBoundaries: [1, 5] } });

for (let step = 0; step < 50; step++) {
  const attrs = { 'train.step': step };
  const span = tracer.startSpan('train_step', { attributes: attrs });
  loss.record(step * 0.25, attrs);
  tokens.add(100, attrs);
  for (const v of [0.5, 2, 9]) grad.record(v, attrs);
  span.end();
  if (step % 7 === 6) await meterProvider.forceFlush(); // a periodic export, at a step we know
}
await meterProvider.shutdown();
await tracerProvider.shutdown();
