// cmd_client.cc — `heads client`: calls a running `heads serve` over gRPC (proto/heads/v1/heads.proto).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "embeddings_out.h"
#include "heads/error.h"
#include "heads/v1/heads.grpc.pb.h"
#include "options.h"
#include "server.h"

namespace heads::cli {

namespace {

struct ClientArgs {
  std::string target = "127.0.0.1:50051", tls_ca, input, output, query;
  std::vector<std::string> texts;
  int64_t chunk = 256;
  double timeout = 600;
  bool quiet = false;
  bool raw_scores = false;
};

std::unique_ptr<heads::v1::Embedder::Stub> connect(const ClientArgs& a) {
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!a.tls_ca.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = serve::read_text_file(a.tls_ca, "--tls-ca");
    creds = grpc::SslCredentials(ssl);
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  args.SetMaxSendMessageSize(64 << 20);
  return heads::v1::Embedder::NewStub(grpc::CreateCustomChannel(a.target, creds, args));
}

void set_deadline(grpc::ClientContext* ctx, double seconds) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
}

[[noreturn]] void rpc_failed(const ClientArgs& a, const char* method, const grpc::Status& s) {
  fail("client: ", method, " on ", a.target, " failed: ", s.error_message(), " (gRPC status ",
       static_cast<int>(s.error_code()), ")");
}

void embed(const ClientArgs& a) {
  const std::vector<std::string> texts = a.input.empty() ? a.texts : read_lines(a.input);
  HEADS_CHECK(!texts.empty(), "client embed: no input texts (give TEXT arguments or an --input file with lines)");
  check_embeddings_output(a.output);
  auto stub = connect(a);
  // Chunks of --chunk texts through EmbedStream: the server batches them with other clients' work
  // while later chunks are still being sent.
  grpc::ClientContext ctx;
  set_deadline(&ctx, a.timeout);
  auto stream = stub->EmbedStream(&ctx);
  std::thread writer([&] {
    for (size_t i = 0; i < texts.size(); i += static_cast<size_t>(a.chunk)) {
      heads::v1::EmbedRequest req;
      for (size_t k = i; k < std::min(texts.size(), i + static_cast<size_t>(a.chunk)); ++k) req.add_texts(texts[k]);
      if (!stream->Write(req)) break;
    }
    stream->WritesDone();
  });
  // Joins the writer on every way out (an error below cancels the call, which ends its writes).
  struct JoinWriter {
    std::thread& t;
    grpc::ClientContext& ctx;
    ~JoinWriter() {
      if (t.joinable()) {
        ctx.TryCancel();
        t.join();
      }
    }
  } join_writer{writer, ctx};
  Tensor e;
  std::string version;
  int64_t done = 0;
  heads::v1::EmbedResponse resp;
  while (stream->Read(&resp)) {
    HEADS_CHECK(version.empty() || resp.model_version() == version, "client: the server's model changed during the ",
                "stream (", version, ", then ", resp.model_version(), "); run again");
    if (!e.defined()) e = Tensor::empty({static_cast<int64_t>(texts.size()), resp.dim()}, DType::F32);
    HEADS_CHECK(resp.first_index() == done && resp.dim() == e.size(1) &&
                    done + resp.embeddings_size() <= e.size(0),
                "client: the server's answer does not fit the request (chunk at ", resp.first_index(), ", expected ",
                done, ")");
    for (int i = 0; i < resp.embeddings_size(); ++i) {
      HEADS_CHECK(resp.embeddings(i).values_size() == e.size(1), "client: an embedding of the wrong size");
      std::memcpy(e.data<float>() + (done + i) * e.size(1), resp.embeddings(i).values().data(),
                  static_cast<size_t>(e.size(1)) * 4);
    }
    done += resp.embeddings_size();
    version = resp.model_version();
  }
  writer.join();
  const grpc::Status s = stream->Finish();
  if (!s.ok()) rpc_failed(a, "EmbedStream", s);
  HEADS_CHECK(done == static_cast<int64_t>(texts.size()), "client: the server answered ", done, " of ",
              texts.size(), " texts");
  write_embeddings(a.output, texts, e, version);
  if (!a.quiet) {
    std::fprintf(stderr, "heads: wrote %lld x %lld embeddings from %s (model %s) to %s\n",
                 static_cast<long long>(e.size(0)), static_cast<long long>(e.size(1)), a.target.c_str(),
                 version.c_str(), a.output.c_str());
  }
}

void rerank(const ClientArgs& a) {
  const std::vector<std::string> texts = a.input.empty() ? a.texts : read_lines(a.input);
  HEADS_CHECK(!texts.empty(), "client rerank: no texts (give TEXT arguments or an --input file with lines)");
  auto stub = connect(a);
  grpc::ClientContext ctx;
  set_deadline(&ctx, a.timeout);
  heads::v1::RerankRequest req;
  req.set_query(a.query);
  for (const std::string& t : texts) req.add_texts(t);
  req.set_raw_scores(a.raw_scores);
  heads::v1::RerankResponse r;
  const grpc::Status s = stub->Rerank(&ctx, req, &r);
  if (!s.ok()) rpc_failed(a, "Rerank", s);
  nlohmann::json out = nlohmann::json::array();
  for (const auto& k : r.ranks()) out.push_back({{"index", k.index()}, {"score", k.score()}});
  std::printf("%s\n", out.dump().c_str());
  if (!a.quiet) std::fprintf(stderr, "heads: %d texts ranked by %s (model %s)\n", r.ranks_size(), a.target.c_str(),
                             r.model_version().c_str());
}

void info(const ClientArgs& a) {
  auto stub = connect(a);
  grpc::ClientContext ctx;
  set_deadline(&ctx, a.timeout);
  heads::v1::InfoResponse r;
  const grpc::Status s = stub->Info(&ctx, heads::v1::InfoRequest(), &r);
  if (!s.ok()) rpc_failed(a, "Info", s);
  std::printf("{\"model_version\": \"%s\", \"dtype\": \"%s\", \"dim\": %lld, \"max_seq_length\": %lld, "
              "\"num_layers\": %lld, \"num_heads\": %lld}\n",
              r.model_version().c_str(), r.dtype().c_str(), static_cast<long long>(r.dim()),
              static_cast<long long>(r.max_seq_length()), static_cast<long long>(r.num_layers()),
              static_cast<long long>(r.num_heads()));
}

// TEXT arguments or --input (one of them), and --quiet.
void add_text_options(CLI::App* c, ClientArgs* a, const char* what) {
  auto* in = c->add_option("--input", a->input, "file with one text per line");
  auto* txt = c->add_option("texts", a->texts, what);
  in->excludes(txt);
  c->add_flag("--quiet", a->quiet, "no note on stderr");
}

void add_connection_options(CLI::App* c, ClientArgs* a) {
  c->add_option("--target", a->target, "the server's gRPC address, HOST:PORT")->capture_default_str();
  c->add_option("--tls-ca", a->tls_ca, "PEM certificate(s) to trust: connect over TLS");
  c->add_option("--timeout", a->timeout, "deadline of the call, seconds")
      ->capture_default_str()->check(CLI::Range(0.001, 86400.0));
}

}  // namespace

void add_client_command(CLI::App& app, Action* action) {
  CLI::App* c = app.add_subcommand("client", "Call a running `heads serve` over gRPC.");
  c->require_subcommand(1);
  auto a = std::make_shared<ClientArgs>();
  CLI::App* e = c->add_subcommand(
      "embed",
      "Embeddings of texts (arguments or the lines of --input) from the server, streamed in chunks;\n"
      "written as `heads embed` writes them (.npy, .safetensors or .jsonl).");
  add_connection_options(e, a.get());
  add_text_options(e, a.get(), "texts to embed");
  e->add_option("--output", a->output, "output file (.npy, .safetensors or .jsonl)")->required();
  e->add_option("--chunk", a->chunk, "texts per streamed request")->capture_default_str()->check(int_in(1, 65536));
  e->callback([a, action] { *action = [a] { embed(*a); }; });
  auto r = std::make_shared<ClientArgs>();
  CLI::App* rk = c->add_subcommand(
      "rerank",
      "Texts (arguments or the lines of --input) scored against --query by the reranker the server\n"
      "serves (gRPC Rerank), printed as POST /rerank answers: [{\"index\", \"score\"}], best first.");
  add_connection_options(rk, r.get());
  rk->add_option("--query", r->query, "the query")->required();
  add_text_options(rk, r.get(), "texts to score");
  rk->add_flag("--raw-scores", r->raw_scores, "the model's logits (default: their sigmoid)");
  rk->callback([r, action] { *action = [r] { rerank(*r); }; });
  auto b = std::make_shared<ClientArgs>();
  CLI::App* i = c->add_subcommand("info", "The model the server serves, as JSON.");
  add_connection_options(i, b.get());
  i->callback([b, action] { *action = [b] { info(*b); }; });
}

}  // namespace heads::cli
