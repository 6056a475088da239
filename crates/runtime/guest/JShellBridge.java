// airlock's Java evaluator: JShell (the JDK's own REPL engine) running cells in this JVM, driven
// by java_kernel.py. Requests come on stdin, one a line: "E <base64 of the cell>" to evaluate,
// "S" to stop the running cell. Everything back goes, in order, as JSON lines on the reply
// channel (the file named by args[0], a pipe of the kernel's): {"stream","text"} for each write
// of the cell's System.out or System.err, then one {"status",...} ending the evaluation.
import java.io.BufferedReader;
import java.io.FileOutputStream;
import java.io.InputStream;
import java.io.InputStreamReader;
import java.io.OutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Base64;
import java.util.List;
import java.util.Locale;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.stream.Collectors;
import jdk.jshell.Diag;
import jdk.jshell.EvalException;
import jdk.jshell.JShell;
import jdk.jshell.JShellException;
import jdk.jshell.Snippet;
import jdk.jshell.SnippetEvent;
import jdk.jshell.SourceCodeAnalysis;
import jdk.jshell.UnresolvedReferenceException;

public class JShellBridge {
    private static volatile boolean stopped;

    public static void main(String[] args) throws Exception {
        PrintStream replies = new PrintStream(new FileOutputStream(args[0]), true, StandardCharsets.UTF_8);
        // A subclass, so that println writes its text and its newline apart, as E2B's Java
        // kernel (IJava) streams them.
        PrintStream out = new PrintStream(new Frames(replies, "stdout"), true, StandardCharsets.UTF_8) {};
        PrintStream err = new PrintStream(new Frames(replies, "stderr"), true, StandardCharsets.UTF_8) {};
        System.setOut(out);
        System.setErr(err);
        // "local": cells run in this JVM (one JVM, not JShell's default second one).
        JShell shell = JShell.builder()
                .executionEngine("local")
                .in(InputStream.nullInputStream())
                .out(out)
                .err(err)
                .build();
        LinkedBlockingQueue<String> cells = new LinkedBlockingQueue<>();
        Thread reader = new Thread(() -> {
            try (BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8))) {
                String line;
                while ((line = in.readLine()) != null) {
                    if (line.equals("S")) {
                        stopped = true;
                        shell.stop();
                    } else if (line.startsWith("E ")) {
                        cells.put(new String(Base64.getDecoder().decode(line.substring(2)), StandardCharsets.UTF_8));
                    }
                }
            } catch (Exception e) {
                // The kernel is gone either way.
            }
            Runtime.getRuntime().halt(0); // the kernel closed our stdin: it has ended
        });
        reader.setDaemon(true);
        reader.start();
        while (true) {
            String code = cells.take();
            stopped = false;
            String reply;
            try {
                reply = evaluate(shell, code);
            } catch (Throwable t) {
                reply = error("InternalError", String.valueOf(t), List.of(String.valueOf(t)));
            }
            out.flush();
            err.flush();
            replies.println(reply);
        }
    }

    /** A cell's output stream: each write one frame on the reply channel. */
    static final class Frames extends OutputStream {
        private final PrintStream replies;
        private final String name;

        Frames(PrintStream replies, String name) {
            this.replies = replies;
            this.name = name;
        }

        @Override
        public void write(int b) {
            write(new byte[] {(byte) b}, 0, 1);
        }

        @Override
        public void write(byte[] b, int off, int len) {
            if (len > 0) {
                String text = new String(b, off, len, StandardCharsets.UTF_8);
                replies.println("{\"stream\":" + quote(name) + ",\"text\":" + quote(text) + "}");
            }
        }
    }

    /** Evaluate a cell snippet by snippet; the last expression's value is the cell's result. */
    static String evaluate(JShell shell, String code) {
        SourceCodeAnalysis analysis = shell.sourceCodeAnalysis();
        String rest = code;
        String value = null;
        while (!rest.isBlank()) {
            SourceCodeAnalysis.CompletionInfo info = analysis.analyzeCompletion(rest);
            String source;
            if (info.completeness() == SourceCodeAnalysis.Completeness.EMPTY) {
                break;
            } else if (info.completeness().isComplete()) {
                source = info.source();
                rest = info.remaining();
            } else {
                source = rest; // incomplete: JShell's own diagnostics say what is missing
                rest = "";
            }
            value = null;
            for (SnippetEvent event : shell.eval(source)) {
                if (event.causeSnippet() != null) {
                    continue; // another snippet updated by this one
                }
                if (stopped) {
                    return error("InterruptedException", "the execution was interrupted", List.of());
                }
                JShellException thrown = event.exception();
                if (thrown != null) {
                    return exception(thrown);
                }
                Snippet snippet = event.snippet();
                if (event.status() == Snippet.Status.REJECTED) {
                    List<String> lines = new ArrayList<>();
                    for (Diag d : shell.diagnostics(snippet).collect(Collectors.toList())) {
                        lines.add(d.getMessage(Locale.ROOT));
                    }
                    lines.add(source.strip());
                    String first = lines.isEmpty() ? "rejected" : lines.get(0);
                    return error("CompilationException", first, lines);
                }
                boolean expression = snippet.kind() == Snippet.Kind.EXPRESSION
                        || snippet.subKind() == Snippet.SubKind.TEMP_VAR_EXPRESSION_SUBKIND;
                if (expression && event.value() != null) {
                    value = event.value();
                }
            }
        }
        return "{\"status\":\"ok\",\"value\":" + (value == null ? "null" : quote(value)) + "}";
    }

    static String exception(JShellException thrown) {
        String name = thrown instanceof EvalException
                ? ((EvalException) thrown).getExceptionClassName()
                : thrown instanceof UnresolvedReferenceException ? "UnresolvedReferenceException" : thrown.getClass().getName();
        String message = thrown.getMessage() == null ? "" : thrown.getMessage();
        List<String> lines = new ArrayList<>();
        lines.add(name + (message.isEmpty() ? "" : ": " + message));
        for (StackTraceElement frame : thrown.getStackTrace()) {
            if (frame.getClassName().startsWith("jdk.") || frame.getClassName().startsWith("java.lang.reflect")) {
                break; // JShell's own machinery below the cell
            }
            lines.add("\tat " + frame);
        }
        return error(name, message, lines);
    }

    static String error(String name, String value, List<String> traceback) {
        return "{\"status\":\"error\",\"ename\":" + quote(name) + ",\"evalue\":" + quote(value) + ",\"traceback\":["
                + traceback.stream().map(JShellBridge::quote).collect(Collectors.joining(",")) + "]}";
    }

    static String quote(String s) {
        StringBuilder b = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            switch (c) {
                case '"': b.append("\\\""); break;
                case '\\': b.append("\\\\"); break;
                case '\n': b.append("\\n"); break;
                case '\r': b.append("\\r"); break;
                case '\t': b.append("\\t"); break;
                default:
                    if (c < 0x20) {
                        b.append(String.format("\\u%04x", (int) c));
                    } else {
                        b.append(c);
                    }
            }
        }
        return b.append('"').toString();
    }
}
