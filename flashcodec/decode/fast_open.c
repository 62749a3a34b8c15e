/*
 * FlashCodec's fast H.264 open for decoders that take no FFmpeg options (torchcodec).
 *
 * FFmpeg's stream-info pass (avformat_find_stream_info) decodes the first 7 or more pictures of an H.264 stream
 * in software only to guess its reorder depth: about 0.07-0.16 s per 1080p open on one core, paid by every NVDEC
 * session and every CPU thread that opens the video. Told `skip_frame=all` for that stream, the pass only parses.
 * PyAV takes that option at av.open; torchcodec calls avformat_find_stream_info(ctx, NULL) and takes none.
 *
 * Loaded RTLD_GLOBAL before torchcodec, this library's avformat_find_stream_info comes first in the process's
 * global symbol scope, so torchcodec's calls (and every other library's) reach it. A call made while its thread is
 * armed (flashcodec_fast_open_arm, by flashcodec/decode/fast_open.py around one decoder's constructor) passes
 * `skip_frame=all` for the armed stream; every other call passes through unchanged. The real function is the one
 * of the libavformat that made the context: an AVFormatContext starts with its AVClass pointer, which points into
 * that library (so a process with two FFmpeg copies, e.g. PyAV's and the system's, calls each its own).
 *
 * A pass that decodes nothing also leaves the stream's pixel format unset, and torchcodec 0.16's NVDEC interface
 * checks the decoder's capabilities against the codec context's pixel format before anything is decoded: with
 * none it decodes on the CPU. So the armed thread's next avcodec_parameters_to_context after such a pass (the
 * constructor making its codec context from the stream's parameters) is given the pixel format the probe read off
 * a decoded keyframe, through the context's "pixel_format" AVOption (no struct layout is read), and only where
 * the context has none.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct AVDictionary AVDictionary;
typedef int (*find_stream_info_fn)(void *, AVDictionary **);
typedef int (*dict_set_fn)(AVDictionary **, const char *, const char *, int);
typedef void (*dict_free_fn)(AVDictionary **);
typedef int (*params_to_context_fn)(void *, const void *);
typedef int (*opt_set_fn)(void *, const char *, const char *, int);
typedef int (*opt_get_pix_fmt_fn)(void *, const char *, int, int *);

/* the options array is sized from the probe's stream count; the spare entries (NULL) cover streams a demuxer
 * may add between the probe's open and this one */
#define SPARE_STREAMS 64

#define EXPORT __attribute__((visibility("default")))

static __thread int armed_stream = -1;
static __thread int armed_streams = 0;
static __thread char armed_format[64];  /* the stream's pixel format name, for the context made after the pass */
static __thread int format_due = 0;     /* a pass decoded nothing: the next context made in this thread gets it */
static atomic_long fast_opens;
static atomic_long formats_set;

/* The next avformat_find_stream_info call in this thread skips decoding for `stream` of `streams`; the codec
 * context made after it gets `pix_fmt` (an FFmpeg pixel format name, or NULL for none) where it has none. */
EXPORT void flashcodec_fast_open_arm(int stream, int streams, const char *pix_fmt) {
  if (stream >= 0 && stream < streams) {
    armed_stream = stream;
    armed_streams = streams;
    armed_format[0] = '\0';
    if (pix_fmt != NULL && strlen(pix_fmt) < sizeof armed_format)
      strcpy(armed_format, pix_fmt);
    format_due = 0;
  }
}

/* 1 when this thread's arm was not used (no call reached this library): the caller says so and disarms. */
EXPORT int flashcodec_fast_open_pending(void) { return armed_stream >= 0; }

EXPORT void flashcodec_fast_open_disarm(void) {
  armed_stream = -1;
  format_due = 0;
  armed_format[0] = '\0';
}

/* Calls that skipped the decode, in this process. */
EXPORT long flashcodec_fast_open_count(void) { return atomic_load(&fast_opens); }

/* Codec contexts given the probe's pixel format after such a call, in this process. */
EXPORT long flashcodec_fast_open_formats_set(void) { return atomic_load(&formats_set); }

static void *owning_library(void *ic) {
  Dl_info where;
  if (ic == NULL || !dladdr(*(void *const *)ic, &where) || where.dli_fname == NULL || where.dli_fname[0] == '\0')
    return NULL;
  return dlopen(where.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
}

/* `name` in `lib` (the library that made the object) or, where that fails or finds this library's `self`, the next
 * definition after this library; NULL when there is none. */
static void *real_function(void *lib, const char *name, void *self) {
  void *real = lib ? dlsym(lib, name) : NULL;
  return real == NULL || real == self ? dlsym(RTLD_NEXT, name) : real;
}

EXPORT int avformat_find_stream_info(void *ic, AVDictionary **options) {
  int stream = armed_stream, streams = armed_streams;
  armed_stream = -1;  /* one call per arm */
  void *lib = owning_library(ic);
  find_stream_info_fn real =
      (find_stream_info_fn)real_function(lib, "avformat_find_stream_info", (void *)avformat_find_stream_info);
  if (real == NULL) {
    if (lib) dlclose(lib);
    return -ENOSYS;  /* AVERROR(ENOSYS) */
  }
  dict_set_fn dict_set = lib ? (dict_set_fn)dlsym(lib, "av_dict_set") : NULL;  /* from its libavutil */
  dict_free_fn dict_free = lib ? (dict_free_fn)dlsym(lib, "av_dict_free") : NULL;
  int ret;
  AVDictionary **opts = NULL;
  if (stream >= 0 && options == NULL && dict_set && dict_free)
    opts = calloc((size_t)streams + SPARE_STREAMS, sizeof *opts);
  if (opts != NULL && dict_set(&opts[stream], "skip_frame", "all", 0) >= 0) {
    ret = real(ic, opts);
    atomic_fetch_add(&fast_opens, 1);
    format_due = ret >= 0 && armed_format[0] != '\0';
  } else {
    ret = real(ic, options);
  }
  if (opts != NULL) {
    for (int i = 0; i < streams + SPARE_STREAMS; i++) dict_free(&opts[i]);
    free(opts);
  }
  if (lib) dlclose(lib);
  return ret;
}

/* Passes every call through to the libavcodec that made `codec`; after a pass that decoded nothing in this thread,
 * sets the armed pixel format on the first context made, if it has none. */
EXPORT int avcodec_parameters_to_context(void *codec, const void *par) {
  void *lib = owning_library(codec);
  params_to_context_fn real = (params_to_context_fn)real_function(lib, "avcodec_parameters_to_context",
                                                                  (void *)avcodec_parameters_to_context);
  if (real == NULL) {
    if (lib) dlclose(lib);
    return -ENOSYS;
  }
  int ret = real(codec, par);
  if (format_due) {
    format_due = 0;
    opt_get_pix_fmt_fn get = lib ? (opt_get_pix_fmt_fn)dlsym(lib, "av_opt_get_pixel_fmt") : NULL;  /* libavutil */
    opt_set_fn set = lib ? (opt_set_fn)dlsym(lib, "av_opt_set") : NULL;
    int current = 0;
    if (ret >= 0 && get && set && get(codec, "pixel_format", 0, &current) >= 0 && current < 0 &&
        set(codec, "pixel_format", armed_format, 0) >= 0)
      atomic_fetch_add(&formats_set, 1);
  }
  if (lib) dlclose(lib);
  return ret;
}
