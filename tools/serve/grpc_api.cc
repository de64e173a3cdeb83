// grpc_api.cc — the gRPC front end of `heads serve`: the heads.v1.Embedder service
// (proto/heads/v1/heads.proto), the standard grpc.health.v1 health service and server reflection.
#include <grpc/grpc.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/support/server_interceptor.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <deque>
#include <nlohmann/json.hpp>
#include <thread>

#include "heads/v1/heads.grpc.pb.h"
#include "heads/mha.h"
#include "server.h"

namespace heads::serve {

namespace {

grpc::StatusCode grpc_code(Code c) {
  switch (c) {
    case Code::Ok: return grpc::StatusCode::OK;
    case Code::InvalidArgument: return grpc::StatusCode::INVALID_ARGUMENT;
    case Code::ResourceExhausted: return grpc::StatusCode::RESOURCE_EXHAUSTED;
    case Code::DeadlineExceeded: return grpc::StatusCode::DEADLINE_EXCEEDED;
    case Code::Cancelled: return grpc::StatusCode::CANCELLED;
    case Code::Unavailable: return grpc::StatusCode::UNAVAILABLE;
    case Code::Internal: return grpc::StatusCode::INTERNAL;
  }
  return grpc::StatusCode::INTERNAL;
}

RequestContext request_context(grpc::ServerContext* ctx, int64_t default_ms) {
  RequestContext rc;
  const auto system_deadline = ctx->deadline();
  const auto now_system = std::chrono::system_clock::now();
  const auto now = Clock::now();
  if (system_deadline == std::chrono::system_clock::time_point::max()) {
    rc.deadline = now + std::chrono::milliseconds(default_ms);
  } else {
    rc.deadline = now + std::chrono::duration_cast<Clock::duration>(system_deadline - now_system);
  }
  rc.cancelled = [ctx] { return ctx->IsCancelled(); };
  return rc;
}

void fill(const EmbedResult& r, int64_t first, heads::v1::EmbedResponse* resp) {
  const size_t n = r.dim ? r.embeddings.size() / static_cast<size_t>(r.dim) : 0;
  for (size_t i = 0; i < n; ++i) {
    auto* values = resp->add_embeddings()->mutable_values();
    values->Resize(static_cast<int>(r.dim), 0.0f);
    std::memcpy(values->mutable_data(), r.embeddings.data() + i * static_cast<size_t>(r.dim),
                static_cast<size_t>(r.dim) * 4);
  }
  resp->set_dim(r.dim);
  resp->set_model_version(r.version);
  resp->set_prompt_tokens(r.prompt_tokens);
  resp->set_first_index(first);
}

// A request tensor as a heads Tensor; false with a message naming `what` when its data does not
// match its shape or the shape is unreasonable.
bool to_tensor(const heads::v1::Tensor& t, const char* what, Tensor* out, std::string* error) {
  if (t.shape_size() < 1 || t.shape_size() > 3) {
    *error = std::string(what) + ": expected 1 to 3 dimensions, got " + std::to_string(t.shape_size());
    return false;
  }
  std::vector<int64_t> shape;
  int64_t n = 1;
  for (int64_t d : t.shape()) {
    if (d < 0 || d > (int64_t{1} << 24) || (d > 0 && n > (int64_t{1} << 26) / d)) {
      *error = std::string(what) + ": dimension " + std::to_string(d) + " out of range";
      return false;
    }
    shape.push_back(d);
    n *= d;
  }
  if (n != t.data_size()) {
    std::string s;
    for (int64_t d : shape) s += (s.empty() ? "" : ", ") + std::to_string(d);
    *error = std::string(what) + ": shape [" + s + "] holds " + std::to_string(n) + " values, got " +
             std::to_string(t.data_size());
    return false;
  }
  *out = Tensor::empty(shape, DType::F32);
  if (n) std::memcpy(out->raw_data(), t.data().data(), static_cast<size_t>(n) * 4);
  return true;
}

void from_tensor(const Tensor& t, heads::v1::Tensor* out) {
  const Tensor c = t.contiguous();
  for (int64_t i = 0; i < c.dim(); ++i) out->add_shape(c.size(i));
  HEADS_CHECK(c.numel() <= (int64_t{1} << 28), "a result of ", c.numel(), " values is too large to send");
  out->mutable_data()->Resize(static_cast<int>(c.numel()), 0.0f);
  if (c.numel()) std::memcpy(out->mutable_data()->mutable_data(), c.raw_data(), static_cast<size_t>(c.numel()) * 4);
}

// A request gRPC could not parse is the client's error: INVALID_ARGUMENT naming the method, not the
// bare INTERNAL that gRPC answers when a message fails to deserialize (before any handler runs).
// Every status this server sets itself carries a message, so an empty INTERNAL is that failure.
class BadMessageInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BadMessageInterceptor(std::string method) : method_(std::move(method)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* m) override {
    using Point = grpc::experimental::InterceptionHookPoints;
    if (m->QueryInterceptionHookPoint(Point::POST_RECV_MESSAGE) && m->GetRecvMessage() == nullptr) unparsed_ = true;
    if (m->QueryInterceptionHookPoint(Point::PRE_SEND_STATUS)) {
      const grpc::Status s = m->GetSendStatus();
      if (s.error_code() == grpc::StatusCode::INTERNAL && (unparsed_ || s.error_message().empty())) {
        m->ModifySendStatus(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                         method_ + ": the request is not a valid protobuf message of its type"));
      }
    }
    m->Proceed();
  }

 private:
  std::string method_;
  bool unparsed_ = false;
};

class BadMessageInterceptorFactory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    return new BadMessageInterceptor(info->method());
  }
};

class EmbedderImpl final : public heads::v1::Embedder::Service {
 public:
  EmbedderImpl(serve::Service* service, Metrics* metrics, bool access_log)
      : service_(service), metrics_(metrics), access_log_(access_log) {}

  grpc::Status Embed(grpc::ServerContext* ctx, const heads::v1::EmbedRequest* req,
                     heads::v1::EmbedResponse* resp) override {
    return timed("Embed", ctx, [&] {
      std::vector<std::string> texts(req->texts().begin(), req->texts().end());
      const EmbedResult r = service_->embed_sync(std::move(texts), request_context(ctx, service_->options().timeout_ms));
      if (r.code != Code::Ok) return grpc::Status(grpc_code(r.code), r.message);
      fill(r, 0, resp);
      return grpc::Status::OK;
    });
  }

  grpc::Status EmbedStream(grpc::ServerContext* ctx,
                           grpc::ServerReaderWriter<heads::v1::EmbedResponse, heads::v1::EmbedRequest>* stream) override {
    return timed("EmbedStream", ctx, [&] {
      // This thread reads chunks and submits them; the writer sends their results in order. All
      // streams together have a bounded number of texts in the server (Service::acquire_stream_texts:
      // the reader waits for answers first), so long streams neither fill the batcher's queue nor
      // pile up results a slow client has not read. A failed chunk ends the stream with its status
      // at once, which also wakes a client that waits for each answer before sending more.
      const Options& opt = service_->options();
      struct Pending {
        int64_t first, n;
        std::future<EmbedResult> result;
      };
      std::mutex mu;
      std::condition_variable cv;
      std::deque<Pending> pending;
      bool reading_done = false;
      grpc::Status status = grpc::Status::OK;
      std::thread writer([&] {
        while (true) {
          std::unique_lock lock(mu);
          cv.wait(lock, [&] { return reading_done || !pending.empty(); });
          if (pending.empty()) return;
          Pending p = std::move(pending.front());
          pending.pop_front();
          lock.unlock();
          const EmbedResult r = p.result.get();
          service_->release_stream_texts(p.n);
          lock.lock();
          const bool write = status.ok() && r.code == Code::Ok;
          if (status.ok() && r.code != Code::Ok) {
            status = grpc::Status(grpc_code(r.code), "texts from " + std::to_string(p.first) + ": " + r.message);
            // Ends the call now with this status (the reader may be blocked in Read); TryCancel
            // would end it as a bare CANCELLED.
            grpc_call_cancel_with_status(ctx->c_call(), static_cast<grpc_status_code>(status.error_code()),
                                         status.error_message().c_str(), nullptr);
          }
          lock.unlock();
          cv.notify_all();
          if (!write) continue;
          heads::v1::EmbedResponse resp;
          fill(r, p.first, &resp);
          if (!stream->Write(resp)) {
            lock.lock();
            if (status.ok()) status = grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
          }
        }
      });
      auto finish = [&] {
        {
          std::lock_guard lock(mu);
          reading_done = true;
        }
        cv.notify_all();
        writer.join();
      };
      try {
        heads::v1::EmbedRequest req;
        int64_t next = 0;
        while (stream->Read(&req)) {
          const auto n = static_cast<int64_t>(req.texts_size());
          if (!service_->acquire_stream_texts(n, [ctx] { return ctx->IsCancelled(); })) break;
          {
            std::lock_guard lock(mu);
            if (!status.ok()) {
              service_->release_stream_texts(n);
              break;
            }
          }
          // Each chunk gets its own default deadline when the client set none.
          auto f = service_->embed({req.texts().begin(), req.texts().end()}, request_context(ctx, opt.timeout_ms));
          {
            std::lock_guard lock(mu);
            pending.push_back({next, n, std::move(f)});
          }
          cv.notify_all();
          next += n;
        }
      } catch (...) {
        finish();
        throw;
      }
      finish();
      return status;
    });
  }

  grpc::Status Rerank(grpc::ServerContext* ctx, const heads::v1::RerankRequest* req,
                      heads::v1::RerankResponse* resp) override {
    return timed("Rerank", ctx, [&] {
      std::vector<std::string> texts(req->texts().begin(), req->texts().end());
      const EmbedResult r =
          service_->rerank(req->query(), req->return_text() ? texts : std::move(texts),
                           request_context(ctx, service_->options().timeout_ms)).get();
      if (r.code != Code::Ok) return grpc::Status(grpc_code(r.code), r.message);
      for (const auto& [i, score] : ranked(r, req->raw_scores())) {
        auto* rank = resp->add_ranks();
        rank->set_index(static_cast<int64_t>(i));
        rank->set_score(score);
        if (req->return_text()) rank->set_text(texts[i]);
      }
      resp->set_model_version(r.version);
      resp->set_prompt_tokens(r.prompt_tokens);
      return grpc::Status::OK;
    });
  }

  grpc::Status Tokenize(grpc::ServerContext* ctx, const heads::v1::TokenizeRequest* req,
                        heads::v1::TokenizeResponse* resp) override {
    return timed("Tokenize", ctx, [&] {
      if (req->texts_size() > service_->options().max_texts) {
        return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            "texts: " + std::to_string(req->texts_size()) + " texts, over the limit of " +
                                std::to_string(service_->options().max_texts));
      }
      const auto m = service_->model();
      for (const std::string& t : req->texts()) {
        const auto e = m->tokenizer().encode(t, m->max_length());
        auto* out = resp->add_texts();
        for (int64_t id : e.ids) {
          out->add_ids(id);
          out->add_pieces(m->tokenizer().token(id));
        }
        out->set_truncated(e.truncated > 0);
      }
      resp->set_model_version(m->version);
      return grpc::Status::OK;
    });
  }

  grpc::Status Attend(grpc::ServerContext* ctx, const heads::v1::AttendRequest* req,
                      heads::v1::AttendResponse* resp) override {
    return timed("Attend", ctx, [&] {
      Tensor q, k, v, pad;
      std::string error;
      if (!req->has_query()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "query: missing");
      if (!to_tensor(req->query(), "query", &q, &error) ||
          (req->has_key() && !to_tensor(req->key(), "key", &k, &error)) ||
          (req->has_value() && !to_tensor(req->value(), "value", &v, &error)) ||
          (req->has_key_padding_mask() && !to_tensor(req->key_padding_mask(), "key_padding_mask", &pad, &error))) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, error);
      }
      if (req->has_key() != req->has_value()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "key and value: give both or neither");
      }
      if (!req->has_key()) k = v = q;
      // Bounds before any work: sequences no longer than the model's positions, and weights of a
      // size a server can give (the service answers one model computation at a time).
      const int64_t max_len = service_->model()->bert().config().max_position_embeddings;
      if (q.dim() < 2 || k.dim() < 2) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "query and key: expected [L, E] or [N, L, E]");
      }
      const int64_t L = q.size(q.dim() - 2), S = k.size(k.dim() - 2);
      if (L > max_len || S > max_len) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "query and key: lengths " + std::to_string(L) + " and " + std::to_string(S) +
                                ", at most " + std::to_string(max_len) + " (the model's max_position_embeddings)");
      }
      if (req->need_weights()) {
        const int64_t N = q.dim() == 3 ? q.size(0) : 1;
        const int64_t heads = req->per_head_weights() ? service_->model()->bert().config().num_heads : 1;
        if (N * heads * L * S > (int64_t{1} << 26)) {
          return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                              "need_weights: " + std::to_string(N * heads * L * S) +
                                  " weights, over the limit of 2^26 per request");
        }
      }
      if (pad.defined()) {
        Tensor b = Tensor::empty(pad.shape(), DType::Bool);
        for (int64_t i = 0; i < pad.numel(); ++i) {
          static_cast<uint8_t*>(b.raw_data())[i] = pad.data<float>()[i] != 0.0f;
        }
        pad = b;
      }
      grpc::Status status = grpc::Status::OK;
      service_->with_model([&](const LoadedModel& m) {
        const auto& layers = m.bert().layers();
        if (layers.empty()) {  // ModernBERT: fused, rotary, pre-norm layers (bert.h)
          status = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                "Attention: model_type \"" + m.bert().config().model_type +
                                    "\" has no nn.MultiheadAttention layers to run (BERT, RoBERTa, MPNet have)");
          return;
        }
        if (req->layer() < 0 || req->layer() >= static_cast<int64_t>(layers.size())) {
          status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                "layer: " + std::to_string(req->layer()) + " is not a layer of this model (0 to " +
                                    std::to_string(layers.size() - 1) + ")");
          return;
        }
        MhaForwardArgs a;
        a.key_padding_mask = pad;
        a.need_weights = req->need_weights();
        a.average_attn_weights = !req->per_head_weights();
        a.is_causal = req->is_causal();  // without attn_mask: causal attention (mha.h)
        try {
          auto [out, w] = layers[static_cast<size_t>(req->layer())].self_attn().forward(q, k, v, a);
          from_tensor(out, resp->mutable_output());
          if (w.defined()) from_tensor(w, resp->mutable_weights());
          resp->set_model_version(m.version);
        } catch (const std::exception& e) {
          status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, e.what());
        }
      });
      return status;
    });
  }

  grpc::Status Info(grpc::ServerContext* ctx, const heads::v1::InfoRequest*, heads::v1::InfoResponse* resp) override {
    return timed("Info", ctx, [&] {
      const auto m = service_->model();
      const auto& cfg = m->bert().config();
      resp->set_model_version(m->version);
      resp->set_model_name(m->name);
      resp->set_dtype(m->dtype);
      resp->set_dim(m->dim());
      resp->set_max_seq_length(m->max_length());
      resp->set_num_layers(cfg.num_layers);
      resp->set_num_heads(cfg.num_heads);
      return grpc::Status::OK;
    });
  }

 private:
  template <typename F>
  grpc::Status timed(const char* method, grpc::ServerContext* ctx, F&& f) {
    const auto t0 = Clock::now();
    grpc::Status s;
    try {
      s = f();
    } catch (const std::exception& e) {
      s = grpc::Status(grpc::StatusCode::INTERNAL, e.what());
    }
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    const std::string route = std::string("grpc:") + method;
    ctx->AddTrailingMetadata("heads-model-version", service_->model()->version);
    metrics_->add("heads_requests_total", {{"route", route}, {"code", std::to_string(static_cast<int>(s.error_code()))}});
    metrics_->observe("heads_request_seconds", {{"route", route}}, secs);
    if (access_log_) {
      log_json("request", nlohmann::json{{"route", route}, {"grpc_code", static_cast<int>(s.error_code())},
                                         {"seconds", secs}, {"peer", ctx->peer()}}
                              .dump());
    }
    return s;
  }

  serve::Service* service_;
  Metrics* metrics_;
  bool access_log_;
};

class GrpcFrontEnd : public FrontEnd {
 public:
  GrpcFrontEnd(Service* service, Metrics* metrics, const ServerOptions& o)
      : impl_(service, metrics, o.access_log), opt_(o) {}

  int start() override {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
    if (!opt_.tls_cert.empty()) {
      grpc::SslServerCredentialsOptions ssl;
      ssl.pem_key_cert_pairs.push_back({read_text_file(opt_.tls_key, "--tls-key"),
                                        read_text_file(opt_.tls_cert, "--tls-cert")});
      creds = grpc::SslServerCredentials(ssl);
    }
    int port = 0;
    const std::string host = opt_.bind.find(':') != std::string::npos ? "[" + opt_.bind + "]" : opt_.bind;
    builder.AddListeningPort(host + ":" + std::to_string(opt_.grpc_port), creds, &port);
    builder.RegisterService(&impl_);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(std::make_unique<BadMessageInterceptorFactory>());
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
    builder.SetMaxReceiveMessageSize(64 << 20);
    builder.SetMaxSendMessageSize(64 << 20);
    server_ = builder.BuildAndStart();
    HEADS_CHECK(server_ && port > 0, "--grpc-port ", opt_.grpc_port, ": cannot listen on ", opt_.bind, ":",
                opt_.grpc_port, " (in use?)");
    auto* health = server_->GetHealthCheckService();
    health->SetServingStatus("heads.v1.Embedder", true);
    return port;
  }

  void not_serving() override {
    if (server_) server_->GetHealthCheckService()->SetServingStatus(false);
  }

  void stop() override {
    if (!server_) return;
    not_serving();
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(static_cast<int64_t>(opt_.drain_seconds * 1000)));
    server_->Wait();
  }

 private:
  EmbedderImpl impl_;
  ServerOptions opt_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace

std::unique_ptr<FrontEnd> make_grpc_front_end(Service* service, Metrics* metrics, const ServerOptions& options) {
  return std::make_unique<GrpcFrontEnd>(service, metrics, options);
}

}  // namespace heads::serve
